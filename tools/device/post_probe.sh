#!/usr/bin/env bash
# Issue 49 item 4: where hybridkv's post-to-landed time goes against raw NIXL, on one GPU host, in ONE device call:
#   run(command="bash tools/device/post_probe.sh", carry=[".whl"])
# Each run is `hybridkv bench transfer --mem vram` under tools/device/post_probe.py (timers around NIXL's posting
# calls and hybridkv's polls); the knobs (PROBE_*, ucxx's futures) are A/B on the same host.
set +e
set -u
[ -n "${HKV_ENV_DONE:-}" ] || source tools/device/env.sh
nvidia-smi -L
ITERS=${ITERS:-15}
i=0
run() {  # run LABEL SIZE ENV...
    local label=$1 size=$2
    shift 2
    i=$((i + 1))
    echo "=== $label: $size $*"
    # shellcheck disable=SC2086  # $size is several options
    env "$@" timeout -k 5 "${BENCH_S:-90}" "$PY" tools/device/post_probe.py bench transfer --mem vram $size \
        --iters "$ITERS" --json >"$OUT/post_probe_$i.json" 2>"$OUT/post_probe_$i.err"
    echo "rc=$?"
    "$PY" tools/device/bench_line.py <"$OUT/post_probe_$i.json"
    grep "post_probe:" "$OUT/post_probe_$i.err" | grep -v "bare[0-9][0-9]" | sed 's/post_probe: /  /'
    grep -i "Traceback\|Error" "$OUT/post_probe_$i.err" | head -3
}
BIG="--tokens 8192"
SMALL="--layers 4 --tokens 384"
for what in ${PROBES:-default spin futures_off ucxx_tcp small small_futures_off}; do
    case $what in
        default) run default "$BIG" ;;
        spin) run "bare posts after a 1 ms spin" "$BIG" PROBE_BARE_SPIN_US=1000 ;;
        futures_off) run "futures off" "$BIG" UCXPY_ENABLE_PYTHON_FUTURE=0 ;;
        ucxx_tcp) run "control plane on tcp,self only" "$BIG" PROBE_UCXX_TLS=tcp,self ;;
        nowait) run "notifier not waiting for the loop" "$BIG" PROBE_NOTIFIER=nowait ;;
        warm) run "one page READ right before each post" "$BIG" PROBE_PREPOST=warm ;;
        prime) run "primer on (DataPlaneConfig.prime)" "$BIG --prime on" ;;
        early) run "one page READ at the fetch's start" "$BIG" PROBE_PREPOST=early ;;
        early_nowait) run "one page READ posted at the fetch's start" "$BIG" PROBE_PREPOST=early_nowait ;;
        prespin) run "a 200 us spin right before each post" "$BIG" PROBE_PREPOST=spin:200 ;;
        small) run "8 MB" "$SMALL" ;;
        small_futures_off) run "8 MB futures off" "$SMALL" UCXPY_ENABLE_PYTHON_FUTURE=0 ;;
        *) echo "unknown probe $what" ;;
    esac
done
