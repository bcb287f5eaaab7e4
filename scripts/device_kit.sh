#!/usr/bin/env bash
# Packs what bench/gpu_device.sh needs on a GPU machine that can reach no registry, into .device/ (git-ignored):
# the wheels its image lacks (cffi and pycparser, for CPython 3.12) and the Debian packages of liburing and
# xxhash's header (unpacked there under .device/root; the image has no liburing-dev).
#
#   bash scripts/device_kit.sh                 # then run (device tool): bash bench/gpu_device.sh, carry .device
#   PY_VERSION=3.11 bash scripts/device_kit.sh # wheels for another Python
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY_VERSION=${PY_VERSION:-3.12}
KIT=.device
rm -rf "$KIT" && mkdir -p "$KIT/wheels" "$KIT/debs"

python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$KIT/wheels" "cffi>=1.17" "pycparser>=2.22"
(cd "$KIT/debs" && apt-get download -qq liburing2 liburing-dev libxxhash-dev)
ls -l "$KIT/wheels" "$KIT/debs"
du -sh "$KIT"
