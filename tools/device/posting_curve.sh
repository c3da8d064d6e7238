#!/usr/bin/env bash
# Issue 49 item 2: the posting curve on the GPU, in ONE device call from the repo root:
#   run(command="bash tools/device/posting_curve.sh", carry=[".whl"])   (.whl from tools/device/wheels.sh)
# `hybridkv bench transfer --mem vram --posting-curve ...` (two processes on one GPU, cuda_ipc), text and JSON in $OUT.
set +e
set -u
CURVE=${CURVE:-1,64,1024,8192,32768,131072}
ITERS=${ITERS:-5}
source tools/device/env.sh
nvidia-smi -L
CLI=("$PY" -c 'import sys; from hybridkv.cli import main; sys.exit(main())' bench transfer --mem vram)
for tokens in ${TOKENS:-8192}; do
    timeout -k 5 "${BENCH_S:-240}" "${CLI[@]}" --tokens "$tokens" --iters "$ITERS" --posting-curve "$CURVE" \
        >"$OUT/posting_curve_$tokens.txt" 2>"$OUT/posting_curve_$tokens.err"
    echo "=== bench tokens=$tokens rc=$?"
    grep -v "NIXL INFO" "$OUT/posting_curve_$tokens.txt"
    grep -i "error\|Traceback" "$OUT/posting_curve_$tokens.err" | head -5
done
