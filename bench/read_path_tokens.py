"""The Loader's steady-state tokens/s over a compact plan beside the same plan materialized (issue 23).

The same run as ``python bench/read_path.py --tokens``, under its own name so ``run_all.py`` keeps its figures
apart from the random-read table: both plan kinds, cold and warm, interleaved run by run, medians and the compact /
materialized ratio. Writes ``read_path_tokens.json``.

Usage::

    python bench/read_path_tokens.py --smoke                          # 8 MiB, one run: seconds
    python bench/read_path_tokens.py --dataset-gib 2 --runs 9         # the figure issue 23 asks for
"""
from __future__ import annotations

import sys

from read_path import main

if __name__ == "__main__":
    sys.exit(main(["--tokens", *sys.argv[1:]]))
