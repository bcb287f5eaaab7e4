#!/usr/bin/env bash
# Every GPU check of the read path in one command, for a CUDA machine that reaches no registry (the device tool):
# build the native core there, run the arena/loader/GPU tests, measure the handoff (bench/gpu_handoff.py).
#
#   bash scripts/device_kit.sh      # here, once: wheels and .debs the GPU image lacks, into .device/
#   bash bench/gpu_device.sh        # there, carrying .device; results and logs land in $OUT (or bench/results/device)
#   READ_PATH=1 bash bench/gpu_device.sh   # also the read-path bench at 16K and 1M (absolute figures on that
#                                          # machine's disk and cores; ~4 more minutes; fio is absent there)
#
# Exit status: gpu_handoff.py's (non-zero if a test failed, the batch was not inside the pinned arena, or the
# CUDA loader's rows differed from the CPU loader's).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-bench/results/device}
mkdir -p "$OUT"
KIT=$PWD/.device

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

{
  date -u; uname -r; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  $PY -c "import sys, torch; print(sys.version.split()[0], torch.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/env.txt"

$PY bench/gpu_handoff.py --build --test 2>&1 | tee "$OUT/gpu_handoff.log"
rc=${PIPESTATUS[0]}
cp bench/results/gpu_handoff.json "$OUT/" 2>/dev/null
if [ "${READ_PATH:-0}" = 1 ]; then
  timeout 420 $PY bench/read_path.py --sizes 16K,1M --runs 3 --no-sweep --data-dir /tmp/foresight-bench \
    2>&1 | tee "$OUT/read_path.log"
  cp bench/results/read_path_16K_1M.json bench/results/read_path_16K_1M.png "$OUT/" 2>/dev/null
fi
echo "gpu_device: exit $rc (results in $OUT)"
exit "$rc"
