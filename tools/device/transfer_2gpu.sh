#!/usr/bin/env bash
# Issue #10: the two-GPU transfer measurement in ONE device call (nvidia-h200-x2), run from the repo root:
#   prefill (producer) on cuda:0, decode (consumer) on cuda:1, over NIXL (UCX), same bytes for
#   hybridkv / raw NIXL one descriptor / vllm-0.33 list, plus a torch GPU0 -> GPU1 copy as the ceiling,
#   UCX's protocol tables (which transports carried the bytes), and the two-process checksum tests.
# Every step is independent (set +e), bounded by `timeout` and by a shared wall-clock budget (BUDGET_S,
# default 135 s), and prints what it did; results are copied to $OUT (at most 8 files come back).
#
#   bash tools/device/transfer_2gpu.sh            # on the device, wheels in .whl (carry [".whl"])
#   TESTS=0 bash tools/device/transfer_2gpu.sh   # benchmarks only, no checksum tests
#   bash tools/device/transfer_2gpu.sh --dry-run  # here, no GPU: DRAM stand-ins for each step, same plumbing
#     (PYTHON=/path/to/python3.12 to pick the interpreter; the wheels are cp312)
set +e
set -u
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/hybridkv_device_out}
SITE=${SITE:-/tmp/site}
BUDGET=${BUDGET_S:-135}
# PAIR=0,0 on a one-GPU machine: the "cross" runs become same-GPU runs (forced cuda_ipc READs included)
# and the separate same-GPU section is not repeated.
PAIR=${PAIR:-0,1}
T0=$(date +%s)
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/hkv2gpu.XXXXXX)

export PYTHONUNBUFFERED=1 UCX_WARN_UNUSED_ENV_VARS=n
# NVLink multicast stays off on shared hosts (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

left() { echo $((BUDGET - ($(date +%s) - T0))); }

# step NAME MAX_S MIN_S CMD...: run CMD under `timeout` (at most MAX_S, never past the budget);
# skipped when fewer than MIN_S seconds are left; CMD's output goes to $STEP_OUT when set.
# Records "NAME rc seconds" in $WORK/steps.
step() {
    local name=$1 max=$2 min=$3 rem t s rc
    shift 3
    rem=$(left)
    t=$((rem < max ? rem : max))
    if [ "$t" -lt "$min" ]; then
        echo "=== [$name] SKIPPED: ${rem}s left of ${BUDGET}s, needs ${min}s"
        echo "$name skipped 0" >>"$WORK/steps"
        return 0
    fi
    echo "=== [$name] start $(date +%T), timeout ${t}s, $(($(date +%s) - T0))s elapsed"
    s=$(date +%s)
    if [ -n "${STEP_OUT:-}" ]; then
        timeout -k 3 "$t" "$@" >"$STEP_OUT" 2>&1
    else
        timeout -k 3 "$t" "$@"
    fi
    rc=$?
    [ "$rc" -eq 124 ] && echo "=== [$name] TIMED OUT after ${t}s"
    echo "=== [$name] rc=$rc in $(($(date +%s) - s))s"
    echo "$name $rc $(($(date +%s) - s))" >>"$WORK/steps"
    return 0
}

# bench NAME MAX_S ENV... -- BENCH_ARGS...: one `bench transfer` run; stdout/stderr -> $WORK/NAME.out
# (echoed here), UCX protocol tables of both processes -> $OUT/ucx_NAME.log.
bench() {
    local name=$1 max=$2 envs=()
    shift 2
    while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    STEP_OUT="$WORK/$name.out" step "bench-$name" "$max" 15 env ${envs[@]+"${envs[@]}"} "$PY" \
        -m hybridkv.cli bench transfer --json --iters 5 --proto-log "$OUT/ucx_$name.log" \
        --raw-splits "${RAW_SPLITS:-2,4,8,32}" "$@"
    grep -v '^{' "$WORK/$name.out" | tail -n 25
    grep '^{' "$WORK/$name.out" | tail -n 1
}

main() {
echo "=== hybridkv two-GPU transfer run, $(date -u +%FT%TZ), dry-run=$DRY, budget ${BUDGET}s, OUT=$OUT"
echo "=== git: $(git log --oneline -1 2>/dev/null) ($(git status --porcelain 2>/dev/null | wc -l) changed paths)"

# 1. wheels: NIXL (nixl_cu13) and ucxx for CUDA 13, trimmed to fit the carry (built by tools/device/wheels.sh)
step install 40 5 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl
export PYTHONPATH="$SITE:$PWD"

# 2. the machine: GPUs, links, peer access, what UCX offers for CUDA memory
envinfo() {
    echo "--- nvidia-smi -L"; nvidia-smi -L
    echo "--- nvidia-smi topo -m"; nvidia-smi topo -m
    echo "--- nvidia-smi topo -p2p r (peer reads)"; nvidia-smi topo -p2p r
    echo "--- nvidia-smi nvlink -s (first 24 lines)"; nvidia-smi nvlink -s | head -n 24
    echo "--- torch"
    "$PY" - <<'EOF'
import torch
n = torch.cuda.device_count()
print("torch", torch.__version__, "cuda", torch.version.cuda, "device_count", n)
for i in range(n):
    print(f"  cuda:{i}", torch.cuda.get_device_name(i))
for a in range(n):
    for b in range(n):
        if a != b:
            print(f"  can_device_access_peer({a},{b}) = {torch.cuda.can_device_access_peer(a, b)}")
EOF
    echo "--- nixl / ucxx"
    "$PY" -c 'from hybridkv.transport.nixl_shim import load_nixl; m = load_nixl(); print("nixl", m.__name__, m.__file__)
import ucxx; print("ucxx", ucxx.__version__)'
    local ui="$SITE/libucx/bin/ucx_info"
    echo "--- ucx_info -v (the libucx wheel's UCX 1.21, ucxx's; NIXL's data path uses the UCX 1.23 it bundles)"
    LD_LIBRARY_PATH="$SITE/libucx/lib" "$ui" -v
    echo "--- ucx_info -d, CUDA transports (default, then UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on)"
    LD_LIBRARY_PATH="$SITE/libucx/lib" "$ui" -d >"$WORK/ucx_info_d.txt" 2>&1
    awk '/Memory domain:/ {p = ($0 ~ /cuda|gdr/)} p' "$WORK/ucx_info_d.txt" \
        | grep -E "Memory domain|Transport:|Device:|memory types|bandwidth|get_zcopy|put_zcopy" | head -n 40
    echo "--- with UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on:"
    UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on LD_LIBRARY_PATH="$SITE/libucx/lib" "$ui" -d 2>&1 \
        | awk '/Memory domain:/ {p = ($0 ~ /cuda_ipc/)} p' | grep -E "Transport:|get_zcopy|put_zcopy"
}
if [ "$DRY" = 1 ]; then
    step env 20 3 "$PY" -c 'import hybridkv.transport.nixl_shim as s; print("nixl", s.load_nixl().__name__); import ucxx; print("ucxx", ucxx.__version__)'
else
    export -f envinfo
    export PY SITE WORK
    step env 25 3 bash -c envinfo
fi
cp "$WORK/ucx_info_d.txt" "$OUT/ucx_info_d.txt" 2>/dev/null

# 3. the measurement (qwen3.5-9b, one 8192-token request, 319,946,752 bytes; median of 5 after a warm-up)
if [ "$DRY" = 1 ]; then
    bench cross 45 -- --layers 4 --tokens 1024
    bench cross_getzcopy 40 UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on -- --layers 4 --tokens 1024
else
    bench cross 45 -- --mem vram --devices "$PAIR"
    # hybridkv's READs with a NIXL notification as well (TransportConfig.notify_reads=True)
    bench cross_notif 30 -- --mem vram --devices "$PAIR" --read-notif on
    # UCX turns cuda_ipc READs (get_zcopy) off when NVML shows no NVLink; READs then go through TCP
    # ("software emulation"). Forcing them on shows what cuda_ipc itself achieves between the GPUs;
    # skipped when the default run already read through cuda_ipc without emulation.
    if "$PY" -c 'import json, sys
r = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
t = (r[-1].get("transports") or {}) if r else {}
sys.exit(0 if t.get("cuda_ipc") and not t.get("software_emulation") else 1)' "$WORK/cross.out" 2>/dev/null; then
        echo "=== [bench-cross_getzcopy] not needed: the default run read through cuda_ipc"
    else
        bench cross_getzcopy 35 UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on -- --mem vram --devices "$PAIR"
    fi
fi

# 4. correctness across the GPUs: pattern-filled pages, sha256 on both sides, PULL (READ) and PUSH (WRITE)
if [ "$DRY" = 1 ]; then
    STEP_OUT="$OUT/pytest.log" step pytest-cross 50 20 "$PY" -m pytest -q -p no:cacheprovider -rs -v \
        tests/transport/test_vram.py
elif [ "${TESTS:-1}" = 0 ]; then
    echo "=== [pytest-cross] not run: TESTS=0" | tee "$OUT/pytest.log"
elif [ "$PAIR" != "0,0" ]; then
    STEP_OUT="$OUT/pytest.log" step pytest-cross 50 20 "$PY" -m pytest -q -p no:cacheprovider -rs -v -m gpu \
        -k cross-gpu tests/transport/test_vram.py
fi
tail -n 15 "$OUT/pytest.log"

# 5. same GPU for comparison (both processes on cuda:0), as much as the budget allows
if [ "$DRY" = 1 ]; then
    bench same 35 -- --layers 4 --tokens 1024
elif [ "$PAIR" = "0,0" ]; then
    STEP_OUT="$WORK/pytest_same.log" step pytest-same 35 25 "$PY" -m pytest -q -p no:cacheprovider -rs -v \
        -m gpu -k same-gpu tests/transport/test_vram.py
    cat "$WORK/pytest_same.log" >>"$OUT/pytest.log" 2>/dev/null && tail -n 6 "$WORK/pytest_same.log"
elif [ "${TESTS:-1}" = 0 ]; then
    bench same 35 -- --mem vram --devices 0,0
else
    bench same 35 -- --mem vram --devices 0,0
    STEP_OUT="$WORK/pytest_same.log" step pytest-same 35 25 "$PY" -m pytest -q -p no:cacheprovider -rs -v \
        -m gpu -k same-gpu tests/transport/test_vram.py
    cat "$WORK/pytest_same.log" >>"$OUT/pytest.log" 2>/dev/null && tail -n 6 "$WORK/pytest_same.log"
fi

# 6. one summary: every bench JSON, transports re-read from the UCX logs (also when a run died), step times
export WORK OUT
timeout 10 "$PY" - <<'EOF'
import json, os, re

work, out = os.environ["WORK"], os.environ["OUT"]
steps = {}
for line in open(os.path.join(work, "steps")):
    name, rc, secs = line.split()
    steps[name] = {"rc": rc, "seconds": int(secs)}
summary = {"steps": steps, "runs": {}}
try:
    from hybridkv.transport.ucx_log import summarize_transports
except Exception as exc:  # still report the numbers
    summarize_transports = None
    print("summary: cannot import the transport summary:", exc)
for name in ("cross", "cross_notif", "cross_getzcopy", "same"):
    if not os.path.exists(os.path.join(work, name + ".out")):
        continue
    run = {}
    path = os.path.join(work, name + ".out")
    if os.path.exists(path):
        js = [l for l in open(path, errors="replace") if l.startswith("{")]
        if js:
            try:
                run = json.loads(js[-1])
            except ValueError as exc:
                run = {"error": f"bad JSON: {exc}"}
        else:
            tail = open(path, errors="replace").read().splitlines()[-6:]
            run = {"error": "no JSON", "tail": tail}
    log = os.path.join(out, f"ucx_{name}.log")
    if os.path.exists(log):
        text = open(log, errors="replace").read()
        if summarize_transports and not run.get("transports"):
            run["transports"] = summarize_transports(text)
        run["ucx_log_counts"] = {k: len(re.findall(p, text)) for k, p in
                                 (("cuda_ipc", r"cuda_ipc/"), ("cuda_copy", r"cuda_copy/"), ("tcp", r"tcp/"),
                                  ("emulation", r"software emulation"), ("cma", r"cma/"))}
    summary["runs"][name] = run
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)

print("=" * 100)
print(f"{'run':<16}{'hybridkv':>10}{'raw':>9}{'vllm':>9}{'copy':>10}  {'hyb/raw':>8}{'hyb/copy':>9}{'raw/copy':>9}"
      f"  posted h/r/v   transports")
for name, r in summary["runs"].items():
    if "hybridkv_GBps" not in r:
        print(f"{name:<16} no result: {r.get('error')} {r.get('tail', '')}")
        t = r.get("transports") or {}
        print(f"{'':<16} transports {t.get('tls')}: {t.get('data_path')}")
        continue
    t = r.get("transports") or {}
    print(f"{name:<16}{r['hybridkv_GBps']:>10.2f}{r['raw_GBps']:>9.2f}{r['vllm_scheme_GBps']:>9.2f}"
          f"{r['copy_GBps']:>10.1f}  {r['ratio']:>8.3f}{r['hybridkv_vs_copy']:>9.4f}{r['raw_vs_copy']:>9.4f}"
          f"  {r['descriptors']}/{r['raw_posted']}/{r['vllm_scheme_posted']}"
          f" (of {r['vllm_scheme_descriptors']})   {','.join(t.get('tls') or [])}"
          f"{' EMULATED' if t.get('software_emulation') else ''}")
    for line in (t.get("data_path") or [])[:6]:
        print(f"{'':<16}  {line}")
    if t.get("emulated_elsewhere"):
        print(f"{'':<16}  emulated but not on the READ path: {t['emulated_elsewhere']}")
    if r.get("post_us"):
        print(f"{'':<16}  make+post us (median): {r['post_us']}; totals us: "
              f"{ {k: round(v * 1e6) for k, v in r['median_s'].items()} }")
    if r.get("raw_notif_GBps"):
        print(f"{'':<16}  raw one span with a notification: {r['raw_notif_GBps']} GB/s; hybridkv notifies: {r['read_notif']}")
    if r.get("raw_split_GBps"):
        print(f"{'':<16}  raw span in N descriptors (GB/s): {r['raw_split_GBps']}")
    print(f"{'':<16}  devices {r.get('devices')}, peer_access {r.get('peer_access')}, copy: {r.get('copy_kind')},"
          f" bytes {r['bytes']:,}")
print("steps:", " ".join(f"{k}={v['rc']}/{v['seconds']}s" for k, v in steps.items()))
EOF

# $OUT: at most 8 files of 16 MiB come back; keep every log under that
for f in "$OUT"/*; do
    [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt 15000000 ] && tail -c 15000000 "$f" >"$f.tmp" && mv "$f.tmp" "$f"
done
echo "=== done in $(($(date +%s) - T0))s; files in OUT: $(ls "$OUT" | tr '\n' ' ')"
}

main "$@" 2>&1 | tee -a "$OUT/run.log"
