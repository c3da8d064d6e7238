#!/usr/bin/env bash
# Build .whl/ for the device machine (Python 3.12, x86-64, CUDA 13; no network there): NIXL and ucxx with
# their libraries, trimmed to fit the device call's 64 MiB carry (tools/device/trim_wheels.py says what is dropped).
# Then: run(command="bash tools/device/transfer_2gpu.sh", carry=[".whl"], kind="nvidia-h200-x2"), or for the GDN
# kernels run(command="bash tools/device/gdn.sh", carry=[".whl"]) (fla-core, pure Python, is fetched too).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RAW="$(mktemp -d)"
PLATFORMS=()
for n in 17 24 27 28; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" --platform manylinux2014_x86_64 -d "$RAW" \
    nixl-cu13==1.5.1 ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.21.0 librmm-cu13==26.10.0 \
    rapids-logger==0.3.0
mkdir -p "$ROOT/.whl"
python3 "$ROOT/tools/device/trim_wheels.py" "$RAW" "$ROOT/.whl"
# pytest-xdist (and execnet) for gdn.sh's TEST_N: the GPU tests compile hundreds of Triton kernels, a CPU's work that
# the device's 16 cores share out, so the whole suite fits in one call.
python3 -m pip download -q --no-deps --only-binary=:all: -d "$ROOT/.whl" fla-core==0.6.0 pytest-xdist==3.8.0 \
    execnet==2.1.2
rm -rf "$RAW"
du -sh "$ROOT/.whl"
