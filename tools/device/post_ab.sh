#!/usr/bin/env bash
# Issue 49 item 4 on one GPU host, plain `hybridkv bench transfer` (no probe wrappers in any timed window): this tree
# against a baseline tree (.old/pkg, made as tools/device/item4.sh says), alternating on one host, and this tree with
# the primer off. From the repo root:
#   run(command="bash tools/device/post_ab.sh", carry=[".whl", ".old"])
# ROUNDS (default 3) alternations of old / new at 320 MB (VRAM, 8192 tokens), then new --prime off once.
set +e
set -u
[ -n "${HKV_ENV_DONE:-}" ] || source tools/device/env.sh
REPO=$PWD
ITERS=${ITERS:-15}
T0=$(date +%s)
bench() {  # bench TREE LABEL ARGS...
    local tree=$1 label=$2 py_path
    shift 2
    if [ "$tree" = old ]; then py_path="$REPO/.old/pkg:$SITE"; else py_path="$REPO:$SITE"; fi
    echo "=== [$(($(date +%s) - T0)) s] $tree $label"
    (cd /tmp && PYTHONPATH=$py_path timeout -k 5 "${BENCH_S:-100}" "$PY" -c \
        'import sys, hybridkv; print(hybridkv.__file__, file=sys.stderr); from hybridkv.cli import main; sys.exit(main())' \
        bench transfer --mem vram --tokens 8192 --iters "$ITERS" --json "$@") 2>"$OUT/ab_${tree}_$label.err" \
        | tee "$OUT/ab_${tree}_$label.json" | "$PY" "$REPO/tools/device/bench_line.py"
    grep -i "Traceback\|Error" "$OUT/ab_${tree}_$label.err" | head -3
}
for r in $(seq "${ROUNDS:-3}"); do
    bench old "320MB_$r"
    bench new "320MB_$r"
done
bench new "320MB_prime_off" --prime off
