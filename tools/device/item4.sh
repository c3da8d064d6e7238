#!/usr/bin/env bash
# Issue 49 item 4 on one GPU host, in ONE device call from the repo root (after preparing .old, see below):
#   run(command="bash tools/device/item4.sh", carry=[".whl", ".old"])
# 1. hybridkv's plan against a raw one-span READ, this tree against a baseline tree (.old/pkg: an older commit's
#    hybridkv laid out as the installed namespace, made here with
#      git archive <commit> hybridkv descriptors connectors sims benchmarks | tar -x -C .old/tree, then
#      .old/pkg/hybridkv = tree/hybridkv with tree/{descriptors,connectors,sims,benchmarks} inside it),
#    alternating runs on the same host, VRAM at 320 and 8 MB and DRAM at 320 MB;
# 2. tools/device/post_probe.sh's probes (where the time goes);
# 3. the staging gather kernel: its GPU tests and `hybridkv bench staging --mem vram`.
set +e
set -u
source tools/device/env.sh
nvidia-smi -L
REPO=$PWD
ITERS=${ITERS:-15}
bench() {  # bench TREE MEM SIZE...  (TREE: new or old)
    local tree=$1 mem=$2 py_path
    shift 2
    if [ "$tree" = old ]; then py_path="$REPO/.old/pkg:$SITE"; else py_path="$REPO:$SITE"; fi
    (cd /tmp && PYTHONPATH=$py_path timeout -k 5 "${BENCH_S:-100}" "$PY" -c \
        'import sys, hybridkv; print(hybridkv.__file__, file=sys.stderr); from hybridkv.cli import main; sys.exit(main())' \
        bench transfer --mem "$mem" "$@" --iters "$ITERS" --json)
}
show() { "$PY" "$REPO/tools/device/bench_line.py"; }
T0=$(date +%s)
at() { echo "=== [$(($(date +%s) - T0)) s] $*"; }
pair() {  # pair LABEL MEM SIZE...: the baseline tree, then this one
    local label=$1 mem=$2 tree
    shift 2
    for tree in old new; do
        [ "$tree" = old ] && [ ! -d .old/pkg/hybridkv ] && continue
        at "$tree $mem $label"
        bench "$tree" "$mem" "$@" 2>"$OUT/item4_${tree}_${label}.err" | tee "$OUT/item4_${tree}_${label}.json" | show
        grep -i "Traceback\|Error" "$OUT/item4_${tree}_${label}.err" | head -3
    done
}
probe() { HKV_ENV_DONE=1 PY=$PY OUT=$OUT PROBES="$*" ITERS=15 bash tools/device/post_probe.sh 2>&1 | grep -v "NIXL INFO\|GPU 0:"; }
# Most wanted first: a run cut short by its limit still returns what it printed and wrote.
pair 320MB_1 vram --tokens 8192
pair 320MB_2 vram --tokens 8192
ITERS=9 pair dram_320MB dram --tokens 8192
at probes; probe default nowait
at "staging gather kernel"
timeout -k 5 100 "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu tests/kernels/test_staging_gather.py 2>&1 | tail -4
timeout -k 5 120 "$PY" -c 'import sys; from hybridkv.cli import main; sys.exit(main())' bench staging --mem vram --iters 9 2>&1 \
    | grep -v "NIXL INFO" | tail -17
if [ -n "${MORE:-}" ]; then  # MORE=1: the 8 MB pair and the other probes too (~90 s more)
    pair 8MB vram --layers 4 --tokens 384
    at probes; probe futures_off ucxx_tcp
fi
at done
