#!/usr/bin/env bash
# Build .whl-qla/ for `QLA=1 bash tools/device/gdn.sh` on the device (Python 3.12, x86-64, CUDA 13; no network
# there): FlashQLA 0.1.3 and what it needs that the device image lacks (tilelang, apache-tvm-ffi, torch-c-dlpack-ext,
# z3-solver; cloudpickle, ml-dtypes, numpy, psutil, tqdm, einops are in the image), plus fla-core 0.6.0, trimmed by
# tools/device/trim_qla_wheels.py so that the folder and the repository fit the call's 64 MiB working tree.
# Then: run(command="QLA=1 bash tools/device/gdn.sh", carry=[".whl-qla"]).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RAW="$(mktemp -d)"
trap 'rm -rf "$RAW"' EXIT
PLATFORMS=()
for n in 17 24 27 28; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" --platform manylinux2014_x86_64 -d "$RAW" \
    flash-qla==0.1.3 tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0 \
    fla-core==0.6.0
du -sh "$RAW"/*.whl
rm -rf "$ROOT/.whl-qla"
python3 "$ROOT/tools/device/trim_qla_wheels.py" "$RAW" "$ROOT/.whl-qla"
total=$(du -cb "$ROOT"/.whl-qla/*.whl | tail -n 1 | cut -f 1)
echo ".whl-qla: $((total / 1048576)) MiB (the device call's working tree, repository included, must stay under 64 MiB)"
