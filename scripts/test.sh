#!/usr/bin/env bash
# Set up every environment the tests need, then run the whole test suite:
# the core suite in .venv, and the engine connector suites each in the
# environment that holds the real engine package (pinned versions).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh || exit 1
status=0
"$ROOT/.venv/bin/python" -m pytest -q --ignore=tests/vllm --ignore=tests/sglang "$@" || status=1
for engine in vllm sglang; do
    if [[ -f "scripts/setup_${engine}.sh" && -d "tests/${engine}" ]]; then
        bash "scripts/setup_${engine}.sh" || { status=1; continue; }
        "$ROOT/.venv-${engine}/bin/python" -m pytest -q "tests/${engine}" "$@" || status=1
    fi
done
exit $status
