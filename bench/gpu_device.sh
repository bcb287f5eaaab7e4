#!/usr/bin/env bash
# Every GPU check of the read path in one command, for a CUDA machine that reaches no registry (the device tool):
# build the native core there (setup.py checks the built _core: errors must cross its binding whole, whatever
# the CC/CXX wrapper did), run each test file in its own process (a crash in one cannot hide the others), then
# measure the handoff (bench/gpu_handoff.py).
#
#   bash scripts/device_kit.sh      # here, once: wheels and .debs the GPU image lacks, into .device/
#   bash bench/gpu_device.sh        # there, carrying .device; results and logs land in $OUT (or bench/results/device)
#   READ_PATH=1 bash bench/gpu_device.sh   # also the read-path bench at 16K and 1M (absolute figures on that
#                                          # machine's disk and cores; ~4 more minutes; fio is absent there)
#   TESTS="tests/test_gpu.py" bash bench/gpu_device.sh     # other test files (default: $TESTS below)
#
# Writes to $OUT: env.txt (machine, versions, how _core linked), tests.txt (one line per step with its exit
# status), tests.log (the build's and every test file's output), gpu_handoff.log/.json (and read_path.*).
# Exit status: non-zero if the build, any test file or gpu_handoff.py failed (tests.txt says which).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-bench/results/device}
mkdir -p "$OUT"
KIT=$PWD/.device
TESTS=${TESTS:-"tests/test_arena.py tests/test_coalesce.py tests/native/test__core.py
  tests/native/test__core_link_variants.py tests/test_gpu.py tests/test_loader.py tests/test_checkpoint_internals.py"}
TEST_TIMEOUT=${TEST_TIMEOUT:-420}  # seconds per test file: a hang costs one file, not the device lease

if compgen -G "$KIT/wheels/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/foresight-site \
    "$KIT"/wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/foresight-site${PYTHONPATH:+:$PYTHONPATH}
fi
if compgen -G "$KIT/debs/*.deb" >/dev/null; then
  mkdir -p "$KIT/root"
  for f in "$KIT"/debs/*.deb; do dpkg -x "$f" "$KIT/root" || exit 1; done
  lib=$KIT/root/usr/lib/x86_64-linux-gnu
  export CPATH=$KIT/root/usr/include${CPATH:+:$CPATH} LIBRARY_PATH=$lib${LIBRARY_PATH:+:$LIBRARY_PATH}
  export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}

SUMMARY=$OUT/tests.txt LOG=$OUT/tests.log
: >"$SUMMARY"
: >"$LOG"
failed=0
# record NAME RC: one summary line; a signal shows as its name (pytest killed by SIGSEGV exits 139).
record() {
  local what="ok"
  if [ "$2" -ne 0 ]; then
    failed=1
    what="FAILED (exit $2)"
    if [ "$2" -gt 128 ]; then what="CRASHED (signal $(kill -l $(($2 - 128)) 2>/dev/null || echo $(($2 - 128))))"; fi
    [ "$2" -eq 124 ] && what="TIMED OUT after ${TEST_TIMEOUT}s"
  fi
  printf '%-48s %s\n' "$1" "$what" | tee -a "$SUMMARY"
}

{
  date -u; uname -r; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  $PY -c "import sys, torch; print(sys.version.split()[0], torch.__version__, 'cuda', torch.cuda.is_available())"
  echo "CC=${CC:-} CXX=${CXX:-} LDFLAGS=${LDFLAGS:-}"; ${CXX:-g++} --version 2>&1 | head -1
} 2>&1 | tee "$OUT/env.txt"

echo "=== build: setup.py build_ext --inplace" >>"$LOG"
$PY setup.py -q build_ext --inplace >>"$LOG" 2>&1
rc=$?
record "build (setup.py build_ext --inplace)" "$rc"
grep -h "^foresight:" "$LOG" | tee -a "$OUT/env.txt"
for so in python/foresight/_core*.so; do
  echo "$so NEEDED: $(readelf -d "$so" 2>/dev/null | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')"
done | tee -a "$OUT/env.txt"
if [ "$rc" -ne 0 ]; then
  tail -40 "$LOG"
  echo "gpu_device: the build failed; no tests run (results in $OUT)"
  exit 1
fi

# The repo's pytest options name pytest-timeout; an image without it still runs the tests.
OPTS=(-q -p no:cacheprovider)
$PY -c "import pytest_timeout" 2>/dev/null || OPTS+=(-o "addopts=-ra")
for t in $TESTS; do
  echo "=== $t" >>"$LOG"
  timeout "$TEST_TIMEOUT" $PY -m pytest "${OPTS[@]}" "$t" >>"$LOG" 2>&1
  rc=$?
  record "$t" "$rc"
  tail -1 "$LOG"
done

$PY bench/gpu_handoff.py 2>&1 | tee "$OUT/gpu_handoff.log"
record "bench/gpu_handoff.py" "${PIPESTATUS[0]}"
cp bench/results/gpu_handoff.json "$OUT/" 2>/dev/null
if [ "${READ_PATH:-0}" = 1 ]; then
  timeout 420 $PY bench/read_path.py --sizes 16K,1M --runs 3 --no-sweep --data-dir /tmp/foresight-bench \
    2>&1 | tee "$OUT/read_path.log"
  record "bench/read_path.py" "${PIPESTATUS[0]}"
  cp bench/results/read_path_16K_1M.json bench/results/read_path_16K_1M.png "$OUT/" 2>/dev/null
fi
echo "--- summary"; cat "$SUMMARY"
echo "gpu_device: exit $failed (results in $OUT)"
exit "$failed"
