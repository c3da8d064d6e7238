#!/usr/bin/env bash
# Issue 49 item 4: hybridkv's plan against a raw one-span READ on the GPU, in ONE device call from the repo root:
#   run(command="bash tools/device/plan_vs_raw.sh", carry=[".whl"])   (.whl from tools/device/wheels.sh)
# `hybridkv bench transfer --mem vram` (two processes on one GPU, cuda_ipc) at ~8, ~64 and 320 MB, each with the
# consumer's wait yielding between polls (--spin-us 0, the default) and polling back to back for 500 us first,
# shuffled rounds; the per-scheme
# table (posting call CPU and wall, post to landed, x raw) of every run in $OUT and on the console. "plan" is
# hybridkv's own index pairs posted with raw's bare calls: hybridkv - plan is what its path adds, plan - raw what
# its two descriptors cost NIXL/UCX (the raw span cut in 2 says the same on one allocation).
# Here, no GPU: MEM=dram PYTHON=.venv/bin/python bash tools/device/plan_vs_raw.sh (the same runs over DRAM, nothing
# installed: env.sh is the device's).
set +e
set -u
ITERS=${ITERS:-15}
MEM=${MEM:-vram}
if [ "$MEM" = vram ]; then
    source tools/device/env.sh
    nvidia-smi -L
else
    PY=${PYTHON:-python3}
    OUT=${OUT:-/tmp/hybridkv_device_out}
    mkdir -p "$OUT"
fi
CLI=("$PY" -c 'import sys; from hybridkv.cli import main; sys.exit(main())' bench transfer --mem "$MEM")
i=0
for size in "--layers 4 --tokens 384" "--tokens 320" "--tokens 8192"; do
    for spin in 0 500; do
        i=$((i + 1))
        # shellcheck disable=SC2086  # $size is two options
        timeout -k 5 "${BENCH_S:-90}" "${CLI[@]}" $size --iters "$ITERS" --spin-us "$spin" --raw-splits 1,2 --json \
            >"$OUT/plan_vs_raw_$i.json" 2>"$OUT/plan_vs_raw_$i.err"
        echo "=== $size --spin-us $spin rc=$?"
        "$PY" - "$OUT/plan_vs_raw_$i.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except ValueError:
    sys.exit("no report")
print(f"{r['bytes'] / 1e6:.1f} MB, median of {r['iters']}; copy {r['copy_GBps']:.0f} GB/s; raw span as 1 and 2 "
      f"descriptors: {r['raw_split_GBps']} GB/s")
for k, v in r["schemes"].items():
    print(f"  {k:<12} posted {v['posted']!s:>5}  CPU {v['post_cpu_us']:>9.1f} us  post {v['post_us']:>9.1f} us"
          f"  landed {v['landed_us']:>10.1f} us  {v['GBps']:>8.1f} GB/s  x raw {v['x_raw']:.3f} (paired {v['x_raw_paired']:.3f})")
print(f"  fetch around its READ (us): {r.get('fetch_phases_us')}")
EOF
        grep -i "error\|Traceback" "$OUT/plan_vs_raw_$i.err" | head -5
    done
done
