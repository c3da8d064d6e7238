#!/usr/bin/env bash
# Create .venv in the repository root with hybridkv installed (editable) and
# everything its tests need. Idempotent: a stamp keyed on pyproject.toml and
# this script skips the install when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"
STAMP="$VENV/.hybridkv-stamp"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
# An editable install rewrites the source tree's hybridkv.egg-info; the engine set-ups do too, and
# scripts/test.sh runs them at once, so that step holds a lock shared by all three.
mkdir -p "$ROOT/.logs"
exec 9>"$ROOT/.logs/editable.lock"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip >/dev/null
# The CPU build of torch lies on this machine's disk; asking for it first keeps
# later requirements (nixl depends on torch) from pulling a multi-GB CUDA build.
pip install -q "torch==2.13.0" 2> >(grep -v "is ignored: it is neither" >&2)
flock 9
pip install -q -e ".[dev,transport,sims]" 2> >(grep -v "is ignored: it is neither" >&2)
flock -u 9
# Triton as on the GPU test machine: the kernels' CPU tests run them in Triton's interpreter.
pip install -q "triton==3.6.0" 2> >(grep -v "is ignored: it is neither" >&2)
echo "$want" > "$STAMP"
