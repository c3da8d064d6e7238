#!/usr/bin/env bash
# Set up .venv, then run the main job. The set-up's output goes to .logs/setup.log.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
mkdir -p .logs
# The stamp is rewritten only when the set-up installs something: only then is there news to print.
before="$(cat .venv/.hybridkv-stamp 2>/dev/null || true)"
[[ -n "$before" ]] || echo "setting up .venv, the first time takes minutes (log: .logs/setup.log) ..." >&2
t0=$SECONDS
if ! bash scripts/setup.sh > .logs/setup.log 2>&1; then
    echo "setting up .venv failed; the end of .logs/setup.log:" >&2
    tail -40 .logs/setup.log >&2
    exit 1
fi
if [[ "$(cat .venv/.hybridkv-stamp)" != "$before" ]]; then
    echo ".venv set up in $((SECONDS - t0)) s" >&2
fi
exec "$ROOT/.venv/bin/hybridkv" demo "$@"
