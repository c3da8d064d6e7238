#!/usr/bin/env bash
# Set up .venv, then run the main job.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec "$ROOT/.venv/bin/hybridkv" demo "$@"
