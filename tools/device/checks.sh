#!/usr/bin/env bash
# The GPU side of a session's checks in ONE device call, from the repo root:
#   run(command="STEPS='probe tests demo bench' bash tools/device/checks.sh", carry=[".whl"])
# (.whl from tools/device/wheels.sh). Steps, each bounded by `timeout`, output in $OUT/<step>.log:
#   probe  what a metadata holder reaches in GPU memory over cuda_ipc (tests/transport/vram_reach_probe.py)
#   tests  every GPU-marked test of the transport and the demo (VRAM, cuda_ipc)
#   demo   `hybridkv demo --device cuda` (token- and byte-exact, fenced)
#   bench  `hybridkv bench transfer --mem vram` ($BENCH_ARGS added)
#   planraw  hybridkv's plan against a raw one-span READ at three sizes (tools/device/plan_vs_raw.sh)
#   staging  heterogeneous-TP staging against the sliced and unmerged lists, VRAM (tests/transport/hetero_peers.py)
#   staging16  the same on vLLM's pages split into 16-token kernel blocks (--kernel-block 16)
#   futures  hybridkv's plan vs raw at 320 and 8 MB with ucxx's Python futures on and off (is the gap its notifier thread?)
#   gather   `hybridkv bench staging --mem vram`: the staging gather against a plain copy (the speed auto assumes)
set +e
set -u
STEPS=${STEPS:-probe tests demo bench}
T0=$(date +%s)
source tools/device/env.sh
nvidia-smi -L
CLI=("$PY" -c 'import sys; from hybridkv.cli import main; sys.exit(main())')
step() {  # step NAME MAX_S CMD...
    local name=$1 max=$2 s
    shift 2
    s=$(date +%s)
    echo "=== [$name] at $((s - T0)) s: $*"
    timeout -k 5 "$max" "$@" >"$OUT/$name.log" 2>&1
    echo "=== [$name] rc=$? in $(($(date +%s) - s)) s"
    grep -v "NIXL INFO\|^\s*$\|dropped a completion notification" "$OUT/$name.log" | tail -n "${TAIL:-40}"
}
for s in $STEPS; do
    case $s in
        probe) step probe 120 "$PY" -m tests.transport.vram_reach_probe ;;
        tests) step tests "${TEST_S:-300}" "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu tests/transport \
                   tests/reference/test_demo_gpu.py ;;
        demo) step demo 200 "${CLI[@]}" demo --device cuda --requests 32 ;;
        bench) step bench "${BENCH_S:-240}" "${CLI[@]}" bench transfer --mem vram --tokens 8192 --iters 9 ${BENCH_ARGS:-} ;;
        planraw) TAIL=60 step planraw "${PLANRAW_S:-330}" bash tools/device/plan_vs_raw.sh ;;
        staging) step staging "${STAGING_S:-240}" "$PY" -m tests.transport.hetero_peers --mem vram --pairs "${PAIRS:-2:1,1:2,4:1,8:2}" ;;
        staging16) step staging16 "${STAGING_S:-240}" "$PY" -m tests.transport.hetero_peers --mem vram --pairs "${PAIRS:-2:1,1:2,4:1,8:2}" --kernel-block 16 ;;
        futures) TAIL=40 step futures "${FUTURES_S:-200}" bash -c 'for size in "--tokens 8192" "--layers 4 --tokens 384"; do
                for f in 1 0; do echo "=== $size UCXPY_ENABLE_PYTHON_FUTURE=$f"; UCXPY_ENABLE_PYTHON_FUTURE=$f "$0" -c "import sys; from hybridkv.cli import main; sys.exit(main())" bench transfer --mem vram $size --iters 15 --json \
                    | "$0" -c "import json,sys; r=json.load(sys.stdin); [print(k, v[\"posted\"], round(v[\"post_us\"],1), round(v[\"landed_us\"],1), round(v[\"x_raw\"],3), round(v[\"x_raw_paired\"],3)) for k,v in r[\"schemes\"].items() if k in (\"hybridkv\",\"plan\",\"raw\")]"; done; done' "$PY" ;;
        gather) step gather 120 "${CLI[@]}" bench staging --mem vram --iters 9 ;;
        *) echo "unknown step $s" ;;
    esac
done
echo "=== done in $(($(date +%s) - T0)) s"
