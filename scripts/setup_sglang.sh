#!/usr/bin/env bash
# Create .venv-sglang in the repository root: the real sglang==0.5.23 (installed
# without its CUDA-only dependencies) plus the few packages that its PD
# disaggregation layer imports on CPU, and hybridkv itself (editable) so that
# our `sglang.srt.plugins` entry point is registered. Idempotent: a stamp keyed
# on pyproject.toml and this script skips the install when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv-sglang"
STAMP="$VENV/.hybridkv-stamp"
want="$(cat pyproject.toml scripts/setup_sglang.sh | sha256sum | cut -d' ' -f1)"

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
pip() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
pip install -q --upgrade pip >/dev/null
# The CPU build of torch lies on this machine's disk; installing it first keeps
# anything later from pulling a multi-GB CUDA build.
pip install -q "torch==2.13.0"
# What sglang's disaggregation layer (bootstrap server, Common* managers,
# ServerArgs, plugin framework) imports on CPU (Triton at .venv's version, so that its ~1 GB is shared), and prometheus-client (an sglang requirement) for the
# backend's sglang:hybridkv_* metrics. sglang itself goes in with
# --no-deps: its declared requirements are CUDA kernels and torch==2.14.1.
pip install -q "torch==2.13.0" numpy msgspec requests pyzmq aiohttp orjson psutil pybase64 \
    pillow starlette packaging pydantic tqdm IPython "transformers==5.19.0" "tokenizers==0.23.2" \
    dill "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" "compressed-tensors==0.18.0" gguf \
    "openai==2.8.0" partial-json-parser "triton==3.6.0" "torchvision==0.28.0" "prometheus-client==0.26.0"
# sglang's declared requirements would pull CUDA kernels and torch==2.14.1;
# pip's complaint about them is expected, so its resolver report is kept in
# a log that is shown only if the step fails.
log="$VENV/.install.log"
pip install -q --no-deps "sglang==0.5.23" >"$log" 2>&1 || { cat "$log"; exit 1; }
flock 9
pip install -q "torch==2.13.0" -e ".[dev,transport]" >"$log" 2>&1 || { cat "$log"; exit 1; }
flock -u 9
# PyPI's torchvision is a CUDA build: next to the CPU torch its C ops do not
# load and `import torchvision` then fails registering fake kernels for two
# undefined ops. SGLang imports torchvision.transforms (pure Python) at module
# level, so a startup hook defines those two op schemas just before
# torchvision is first imported. Nothing else changes.
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cat >"$site/_hybridkv_torchvision_cpu.py" <<'PY'
import sys


class _Finder:
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        for op in ("nms", "qnms"):
            try:
                torch.library.define(
                    f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
                )
            except RuntimeError:
                pass  # the real extension is loaded and defined it
        return None


sys.meta_path.insert(0, _Finder())
PY
echo "import _hybridkv_torchvision_cpu" >"$site/_hybridkv_torchvision_cpu.pth"
"$VENV/bin/python" -c "import sglang.srt.disaggregation.common.conn" || exit 1
echo "$want" > "$STAMP"
