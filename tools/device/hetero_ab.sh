#!/usr/bin/env bash
# The staged hetero-TP fetch at model size on one GPU host, this tree against baseline trees (each a folder with
# pkg/hybridkv, made as tools/device/item4.sh says for .old, from an earlier commit), alternating on the same host:
#   run(command="bash tools/device/hetero_ab.sh", carry=[".whl", ".old58"])
# BASES (default .old58: the baseline folders, in order), PAIRS (4:1,8:2,2:1,1:2), KB (the kernel block, default
# 16; empty: hybridkv's own layout), ROUNDS (2).
set +e
set -u
[ -n "${HKV_ENV_DONE:-}" ] || source tools/device/env.sh
REPO=$PWD
KB=${KB-16}
for r in $(seq "${ROUNDS:-2}"); do
    for tree in ${BASES:-.old58} new; do
        [ "$tree" != new ] && [ ! -d "$tree/pkg/hybridkv" ] && { echo "no $tree/pkg/hybridkv: skipped"; continue; }
        if [ "$tree" = new ]; then py_path="$REPO:$SITE"; else py_path="$REPO/$tree/pkg:$REPO:$SITE"; fi
        echo "=== $tree round $r (kernel block ${KB:-none})"
        # from /tmp, so that the baseline's hybridkv is the one imported (the repo root would come first)
        (cd /tmp && PYTHONPATH=$py_path timeout -k 5 "${HETERO_S:-200}" "$PY" -c 'import hybridkv, sys; print(hybridkv.__file__, file=sys.stderr); import runpy; runpy.run_module("tests.transport.hetero_peers", run_name="__main__", alter_sys=True)' \
            --mem vram --model qwen3.5-9b --tokens 8192 --pairs "${PAIRS:-4:1,8:2,2:1,1:2}" --gather-gbps 150 \
            ${KB:+--kernel-block $KB}) 2>&1 | tee "$OUT/hetero_${tree#.}_k${KB:-none}_$r.txt" \
            | grep -v "NIXL INFO" | grep -E "^P TP|call to return|Export in|staging copies|hybridkv/__init__"
    done
done
