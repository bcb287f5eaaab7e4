"""``python -m foresight.demo``: the same as ``foresight demo``."""
from foresight.demo import main

raise SystemExit(main())
