#!/usr/bin/env bash
# Create .venv-vllm in the repository root: the real vllm==0.33.0 package on a
# CPU torch, enough of its dependencies to run its scheduler, KV cache planning
# and KV connector code (no model execution), plus hybridkv (editable) with its
# test and transport dependencies. Used by tests/vllm.
#
# vLLM's wheel pins a CUDA torch 2.14 and ~70 GPU/serving packages; the
# connector/scheduler import path needs none of them, so vllm goes in with
# --no-deps and the light dependencies below are pinned by hand.
# Idempotent: a stamp keyed on pyproject.toml and this script skips the install
# when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv-vllm"
STAMP="$VENV/.hybridkv-stamp"
want="$(cat pyproject.toml scripts/setup_vllm.sh | sha256sum | cut -d' ' -f1)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi
# Hard links to .venv's files (scripts/seed_env.sh), rebuilt from scratch when this script or
# pyproject.toml changed.
source "$ROOT/scripts/seed_env.sh"
seed_env "$VENV"
# scripts/test.sh runs the two engine set-ups at once; an editable install rewrites the source tree's
# hybridkv.egg-info, so that step holds a lock shared by all three set-ups.
mkdir -p "$ROOT/.logs"
exec 9>"$ROOT/.logs/editable.lock"
pip() { "$VENV/bin/python" -m pip "$@"; }
quiet() { grep -v "is ignored: it is neither" >&2 || true; }
pip install -q --upgrade pip >/dev/null
# Triton came with the seed; this environment never had it, and vLLM picks other code paths when it imports.
pip uninstall -q -y triton >/dev/null 2>&1 || true

# One resolver run for torch (the CPU build on this machine's disk: asking for
# it here keeps nixl's torch requirement from pulling a multi-GB CUDA build),
# vLLM's light dependencies and hybridkv itself.
flock 9  # held through this resolver run, which includes the editable install
pip install -q 2> >(quiet) \
    "torch==2.13.0" \
    -e ".[dev,transport]" \
    aiohttp==3.14.5 \
    apache-tvm-ffi==0.1.11 \
    blake3==1.0.11 \
    cachetools==8.0.2 \
    cbor2==6.3.0 \
    cloudpickle==3.1.3 \
    einops==0.8.2 \
    fastapi==0.136.3 \
    llguidance==1.7.6 \
    loguru==0.7.3 \
    msgspec==0.23.0 \
    openai==3.57.0 \
    oss-harmony==0.0.11 \
    packaging==26.4 \
    partial-json-parser==0.2.1.1.post7 \
    pillow==13.0.0 \
    prometheus_client==0.26.0 \
    psutil==7.2.2 \
    py-cpuinfo==9.0.0 \
    pybase64==1.5.1 \
    pydantic==2.14.4 \
    pyzmq==27.3.0 \
    regex==2026.11.19 \
    requests==2.34.2 \
    tqdm==4.70.1 \
    transformers==5.20.2 \
    urllib3==2.8.0 \
    uvloop==0.23.0

flock -u 9

# vllm, xgrammar and compressed-tensors declare (CUDA) torch requirements that
# this CPU environment deliberately does not satisfy.
pip install -q --no-deps 2> >(quiet) \
    vllm==0.33.0 \
    xgrammar==0.2.8 \
    compressed-tensors==0.17.0

echo "$want" > "$STAMP"
