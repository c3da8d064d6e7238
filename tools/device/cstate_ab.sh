#!/usr/bin/env bash
# Is the post slower with ucxx's Python futures because of the GIL or because the core sleeps between transfers?
# Futures on (hybridkv's default), 320 MB plan vs raw, with and without a PM QoS request that keeps every core out of
# deep idle states (/dev/cpu_dma_latency = 0, held open for the run; needs the right to open it). From the repo root:
#   run(command="bash tools/device/cstate_ab.sh", carry=[".whl"])
set -u
source tools/device/env.sh
for qos in off on; do
    holder=""
    if [ "$qos" = on ]; then
        "$PY" -c 'import os, struct, time; fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY); os.write(fd, struct.pack("i", 0)); print("PM QoS held", flush=True); time.sleep(600)' &
        holder=$!
        sleep 1
    fi
    echo "=== 320 MB, futures on, PM QoS latency 0: $qos"
    UCXPY_ENABLE_PYTHON_FUTURE=1 "$PY" -c "import sys; from hybridkv.cli import main; sys.exit(main())" bench transfer --mem vram \
        --tokens 8192 --iters 15 --json 2>"$OUT/cstate_$qos.err" \
        | "$PY" -c "import json,sys; r=json.load(sys.stdin); [print(k, v['posted'], round(v['post_us'],1), round(v['landed_us'],1), round(v['x_raw'],3), round(v['x_raw_paired'],3)) for k,v in r['schemes'].items() if k in ('hybridkv','plan','raw')]"
    [ -n "$holder" ] && kill "$holder"
done
