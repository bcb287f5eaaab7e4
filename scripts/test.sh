#!/usr/bin/env bash
# Set up (idempotent), then run the whole test suite, bench smoke runs included.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# A test that hangs to its timeout is run once more: a few process-spawning tests have been seen to hang late in a
# full run (a child stuck in the kernel, not reproduced alone; see the issue notes). Any other failure fails at once,
# and a rerun is reported in the summary ("rerun"), never hidden.
exec .venv/bin/python -m pytest -q --reruns 1 --only-rerun "Timeout" "$@"
