#!/usr/bin/env bash
# Issue #24: `hybridkv demo --device cuda` on the device machine, in ONE call, from the repo root:
#   run(command="bash tools/device/demo_gpu.sh", carry=[".whl"])   (.whl from tools/device/wheels.sh)
# PAIR=0,1 on a two-GPU machine (default 0,0: prefill and decode processes on one GPU). Each step is bounded by
# `timeout` and its output kept in $OUT; the JSON lines are the reports.
set +e
set -u
PAIR=${PAIR:-0,0}
REQUESTS=${REQUESTS:-32}
T0=$(date +%s)
source tools/device/env.sh
# main() imported rather than `-m hybridkv.cli`: as __main__ its CommandError is not the one the demo raises,
# so a --timeout would end in a traceback instead of the error line.
CLI=("$PY" -c 'import sys; from hybridkv.cli import main; sys.exit(main())' demo)
if ! "${CLI[@]}" -h >/dev/null 2>&1; then
    echo "hybridkv.cli has no demo subcommand here: calling the demo's CLI module directly"
    CLI=("$PY" -c 'import argparse, sys; from hybridkv.connectors.reference import demo_cli
p = argparse.ArgumentParser(prog="hybridkv demo"); demo_cli.register(p); a = p.parse_args(); sys.exit(a.handler(a))')
fi
nvidia-smi -L
"$PY" -c 'import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.device_count(), "GPU")'

run() {  # run NAME MAX_S ARGS...: one demo, its text and JSON in $OUT/NAME.log
    local name=$1 max=$2
    shift 2
    echo "=== [$name] $(($(date +%s) - T0))s: hybridkv demo $*"
    local s=$(date +%s)
    timeout -k 5 "$max" "${CLI[@]}" --device cuda --devices "$PAIR" --requests "$REQUESTS" "$@" \
        >"$OUT/$name.log" 2>"$OUT/$name.err"
    echo "=== [$name] rc=$? in $(($(date +%s) - s))s"
    grep -v "NIXL INFO\|^\s*$" "$OUT/$name.log" | tail -n 45
    grep -i "error\|Traceback" "$OUT/$name.err" | head -n 5
    tail -n 20 "$OUT/$name.err" | grep -v "NIXL INFO" | tail -n 8
}
# WARMUP=1: one small run first, so that Triton's compiles and autotuning (cached on disk) are out of the figures
if [ "${WARMUP:-0}" = 1 ]; then
    SAVED=$REQUESTS
    REQUESTS=8
    run warmup 150 --json ${DEMO_ARGS:-}
    REQUESTS=$SAVED
fi
[ "${TABLE_RUN:-1}" = 1 ] && run fenced "${FENCED_S:-200}" ${DEMO_ARGS:-}
[ "${JSON_RUN:-1}" = 1 ] && run fenced_json "${FENCED_S:-200}" --json ${DEMO_ARGS:-}
[ "${NONE_RUN:-1}" = 1 ] && run none "${NONE_S:-150}" --policy none --json ${DEMO_ARGS:-}
if [ "${TESTS:-1}" = 1 ]; then
    echo "=== [pytest] $(($(date +%s) - T0))s"
    timeout -k 5 "${TEST_S:-150}" "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu tests/reference/test_demo_gpu.py \
        >"$OUT/pytest.log" 2>&1
    echo "=== [pytest] rc=$?"
    tail -n 15 "$OUT/pytest.log"
fi
echo "=== done in $(($(date +%s) - T0))s"
