#!/usr/bin/env bash
# Set up (idempotent), then run the whole test suite, bench smoke runs included.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
