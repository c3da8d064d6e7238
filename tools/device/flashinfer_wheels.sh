#!/usr/bin/env bash
# Build .whl-fi1/ and .whl-fi2/ for `FI=1 bash tools/device/gdn.sh` on the device (Python 3.12, x86-64, CUDA 13;
# no network there): FlashInfer 0.7.2 and what its GDN prefill needs that the device image lacks, plus fla-core 0.6.0
# for the FLA column. Its wheel declares more (cuda-python, cuda-tile, nccl4py, nccl-extensions,
# nvidia-cudnn-frontend and the image's click, einops, ninja, requests, tabulate, tqdm, ...): none of the first five is
# imported on the way to its sm90 GDN prefill (`import flashinfer.gdn_prefill`, then the kernel's compile, ran on a CPU
# with only this set and the image's packages), and the image has the rest, cuda-bindings among them.
#
# The set is ~330 MB installed; nvidia-cutlass-dsl-libs-cu13 alone is 92 MB as a wheel (the CuTe DSL compiler,
# 193 MB, and its runtime library, 44 MB: one file each, nothing to leave out). trim_fi_wheels.py drops what the sm90
# GDN prefill never reads (its docstring says what and why) and writes the wheels stored; wheel_parts.py compresses
# them as one xz stream and cuts it into parts of at most PART_MIB (48) MiB, one folder each, so that each call's
# working tree (the repository, ~2 MiB, plus one folder) stays under 64 MiB. Two calls, back to back: the first
# lands part 1 and checks the machine; the second finds part 1 still there (ignored folders stay on a warm machine),
# joins the parts, installs them with `pip install --no-deps --target .pkgs-fi` in one go (the three nvidia-cutlass-dsl
# wheels share the folder nvidia_cutlass_dsl/, which a second pip --target would skip or replace) and runs the bench:
#   run(command="FI=land bash tools/device/gdn.sh", carry=[".whl-fi1"])
#   run(command="FI=1 bash tools/device/gdn.sh", carry=[".whl-fi2"])
# If the second call finds a fresh machine (the first one was given back), it says which part is missing: run both
# again. A set cut into more parts (a smaller PART_MIB) takes one `FI=land` call per folder before the last.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PART_MIB=${PART_MIB:-48}
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/raw" "$WORK/stored"
PLATFORMS=()
for n in 17 24 27 28; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" --platform manylinux2014_x86_64 -d "$WORK/raw" \
    flashinfer-python==0.7.2 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.12 fla-core==0.6.0
du -sh "$WORK"/raw/*.whl
python3 "$ROOT/tools/device/trim_fi_wheels.py" "$WORK/raw" "$WORK/stored"
rm -rf "$ROOT"/.whl-fi[0-9]*
echo "packing (xz -9e of ~330 MB: a few minutes)"
python3 "$ROOT/tools/device/wheel_parts.py" pack "$WORK/stored" "$ROOT/.whl-fi" --part-mib "$PART_MIB"
tree=$(cd "$ROOT" && { git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 du -cb 2>/dev/null \
    | awk '$2 == "total" {s += $1} END {print s}')
for d in "$ROOT"/.whl-fi[0-9]*; do
    part=$(du -cb "$d" | tail -n 1 | cut -f 1)
    echo "$(basename "$d"): $((part / 1048576)) MiB + working tree $((tree / 1048576)) MiB (of 64 MiB for one call)"
    if [ $((part + tree)) -ge $((64 * 1048576)) ]; then
        echo "too large for one call: lower PART_MIB" >&2
        exit 1
    fi
done
