#!/usr/bin/env bash
# Set up (idempotent), then run the whole test suite, bench smoke runs included.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# No reruns: a test that hangs is a defect to find (tests/conftest.py says how the last one was found and fixed).
exec .venv/bin/python -m pytest -q "$@"
