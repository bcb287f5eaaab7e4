import sys

from foresight.cli import main

sys.exit(main())
