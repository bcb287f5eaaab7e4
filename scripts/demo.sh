#!/usr/bin/env bash
# Set up (idempotent), then run the end-to-end demo on its embedded default dataset.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m foresight demo "$@"
