#!/usr/bin/env bash
# Issue #8 on the device (nvidia-h200), run from the repo root with the wheels in .whl (carry [".whl"]):
#   the GPU tests of the GDN kernels, then `bench gdn` side by side with fla-core 0.6.0, as JSON in $OUT.
#
#   bash tools/device/gdn.sh                 # tests + prefill + decode
#   ONLY=prefill ITERS=10 bash tools/device/gdn.sh
#   TESTS=0 bash tools/device/gdn.sh         # benchmark only
#   TEST_SHARD=1/2 TEST_S=480 BENCH=0 bash ...    # half of the GPU tests (then 2/2): the suite outgrew one call
#   TEST_N=8 TEST_S=560 BENCH=0 bash ...          # the whole suite in eight processes (pytest-xdist from .whl)
#   BREAKDOWN=1 bash tools/device/gdn.sh     # first: per-kernel device time vs call time, hybridkv and FLA
#   HOSTPROF=1 bash tools/device/gdn.sh      # first: where each call's host time goes (cProfile), hybridkv and FLA
#                                               # (NO_FLA=1: hybridkv only, without FLA's minutes of autotuning)
#   PROBE=1 BENCH=0 bash tools/device/gdn.sh # tests, then every chunk schedule/config and decode hint
#                                               # (PROBE_ONLY=prefill PROBE_SHAPES=4x8192 PROBE_QUICK=1: serial, the plan
#                                               # and pipelined x2 / x4 on the batched shapes only)
#   POOLS=1 ... bash tools/device/gdn.sh        # first: the decode tuner in vLLM/SGLang-shaped slot pools (pool_probe.py)
#   QLA=1 bash tools/device/gdn.sh  # FlashQLA beside FLA's Triton path (issue 23), carry [".whl-qla"] built here by
#                                        # tools/device/flashqla_wheels.sh (fla-core is in it); prefill only, no
#                                        # tests unless ONLY= / TESTS=1 say otherwise; QLA_BUDGET_S (420 s) in all
#   FI=land bash tools/device/gdn.sh  # FlashInfer 0.7.2 beside FLA's Triton path (issue 23), in two calls back to
#   FI=1 bash tools/device/gdn.sh     # back on one warm machine: carry [".whl-fi1"], then [".whl-fi2"], built
#                                        # here by tools/device/flashinfer_wheels.sh (fla-core is in them). The
#                                        # first checks its part and the image; the second joins the parts, installs
#                                        # them into .pkgs-fi and runs the prefill bench; FI_BUDGET_S (520 s) in all.
#                                        # FI=1 ONLY=decode: FlashInfer's pool decode beside hybridkv's instead (ONLY=
#                                        # empty: both)
# hybridkv is not installed there: the bench runs through its module's own register/handler, and benchmarks/ is linked
# in as hybridkv/benchmarks (what the editable install's package-dir does here).
set -u
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/hybridkv_gdn_out}
mkdir -p "$OUT"
[ -e hybridkv/benchmarks ] || ln -s "$PWD/benchmarks" hybridkv/benchmarks
if [ "${FI:-0}" = land ]; then
    # A call before the last of an FI run: its .whl-fi folder stays on this machine for the next call (ignored
    # folders do while it is warm). Checks the part(s) here, and what the install takes from the image.
    "$PY" tools/device/wheel_parts.py check .whl-fi[0-9]*
    "$PY" -c 'import lzma, sys, torch; print("python", sys.version.split()[0], "lzma ok; torch", torch.__version__,
        "cuda", torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())'
    "$PY" -m pip list 2>/dev/null | grep -i -E "^(cuda-(bindings|core|pathfinder)|filelock|numpy|protobuf|requests|\
click|tabulate|einops|tqdm|packaging|nvidia-ml-py|typing.extensions|apache-tvm-ffi|flashinfer|nvidia-cutlass) "
    exit 0
fi
if [ "${QLA:-0}" != 0 ]; then
    qla_t0=$SECONDS  # the whole QLA run stays inside QLA_BUDGET_S: the bench gets what the set-up left
    # Into .pkgs, not the image's site-packages: tilelang's libraries find tvm_ffi and z3 beside it by RUNPATH.
    timeout 90 "$PY" -m pip install -q --no-deps --no-index --no-compile --target .pkgs "${QLA_DIR:-.whl-qla}"/*.whl \
        2>&1 | tail -n 2
    ln -sf libz3.so.4.15 .pkgs/z3/lib/libz3.so  # trim_qla_wheels.py keeps one copy of the library, for both names
    export PYTHONPATH="$PWD/.pkgs${PYTHONPATH:+:$PYTHONPATH}"
    if [ -z "${CUDA_HOME:-}" ]; then  # TileLang's JIT runs nvcc and includes the toolkit's headers
        nvcc_at=$(readlink -f "$(command -v nvcc || echo /none/bin/nvcc)")
        for d in /usr/local/cuda "$(dirname "$(dirname "$nvcc_at")")" /usr/local/cuda-13*; do
            [ -x "$d/bin/nvcc" ] && [ -f "$d/include/cuda_runtime.h" ] && export CUDA_HOME="$d" && break
        done
    fi
    export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH" TILELANG_CACHE_DIR="${TILELANG_CACHE_DIR:-/tmp/tilelang_cache}"
    echo "CUDA_HOME=${CUDA_HOME:-not found}: $(nvcc --version 2>&1 | tail -n 1)"
    timeout 60 "$PY" -c 'import fla, flash_qla, tilelang; print("fla-core", fla.__version__, "flash-qla",
        flash_qla.__version__, "tilelang", tilelang.__version__)' 2>&1 | grep -v -i warn | tail -n 3
    TESTS=${TESTS:-0} ONLY=${ONLY-prefill} BENCH_S=${BENCH_S:-$(( ${QLA_BUDGET_S:-420} - 10 - (SECONDS - qla_t0) ))}
    # Warm-ups (TileLang compiles) first; the timing after them takes well under 150 s.
    WARM_S=${WARM_S:-$(( BENCH_S - 150 < 240 ? (BENCH_S - 150 > 60 ? BENCH_S - 150 : 60) : 240 ))}
    echo "set-up took $((SECONDS - qla_t0)) s; bench timeout $BENCH_S s, warm-ups $WARM_S s"
elif [ "${FI:-0}" != 0 ]; then
    fi_t0=$SECONDS  # the whole FI run stays inside FI_BUDGET_S: the bench gets what the set-up left
    pack=$("$PY" -c 'import glob, json
print(json.load(open(sorted(glob.glob(".whl-fi[0-9]*/MANIFEST.json"))[0]))["sha256"])' 2>/dev/null)
    if [ -n "$pack" ] && [ -f ".pkgs-fi/.pack-$pack" ]; then
        # A repeated FI=1 call on the same warm machine (say, after a bench cut short: Triton's and FlashInfer's
        # disk caches are filled now) skips the join and install.
        echo "reusing .pkgs-fi, installed from pack $pack"
    else
        rm -rf .pkgs-fi /tmp/whl-fi
        "$PY" tools/device/wheel_parts.py unpack .whl-fi[0-9]* --to /tmp/whl-fi || exit 1
        # All in one pip call: the three nvidia-cutlass-dsl wheels fill one folder, nvidia_cutlass_dsl/. Into
        # .pkgs-fi, not QLA's .pkgs, so that FlashQLA left there by an earlier run here stays out of this one.
        timeout 120 "$PY" -m pip install -q --no-deps --no-index --no-compile --target .pkgs-fi /tmp/whl-fi/*.whl \
            2>&1 | tail -n 2
        [ "${PIPESTATUS[0]}" = 0 ] && touch ".pkgs-fi/.pack-$pack"
    fi
    # A --target folder is no site directory: nvidia-cutlass-dsl's .pth, which puts `cutlass` on the path, is not
    # read there, so its folder goes on PYTHONPATH by hand.
    export PYTHONPATH="$PWD/.pkgs-fi:$PWD/.pkgs-fi/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
    export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer_ws}  # its CuTe DSL kernel cache
    timeout 120 "$PY" -c 'from importlib.metadata import version as v
import fla, flashinfer, flashinfer.gdn_prefill
print("fla-core", fla.__version__, "flashinfer", flashinfer.__version__, "nvidia-cutlass-dsl",
      v("nvidia-cutlass-dsl-libs-base"), "apache-tvm-ffi", v("apache-tvm-ffi"), "cuda-bindings", v("cuda-bindings"))' \
        2>&1 | grep -v -i warn | tail -n 3
    TESTS=${TESTS:-0} ONLY=${ONLY-prefill} BENCH_S=${BENCH_S:-$(( ${FI_BUDGET_S:-520} - 10 - (SECONDS - fi_t0) ))}
    echo "set-up took $((SECONDS - fi_t0)) s; bench timeout $BENCH_S s"
else
    "$PY" -m pip install -q --no-deps --no-index .whl/fla_core-0.6.0-py3-none-any.whl 2>&1 | tail -n 1
fi
if [ "${TEST_N:-0}" != 0 ]; then  # pytest-xdist from .whl (tools/device/wheels.sh): tests in TEST_N processes
    "$PY" -m pip install -q --no-deps --no-index .whl/execnet-*.whl .whl/pytest_xdist-*.whl 2>&1 | tail -n 1
fi
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
if [ "${POOLS:-0}" != 0 ]; then  # the decode tuner's pick in engine-shaped slot pools, in-pool vs dense-scratch tuning
    PYTHONUNBUFFERED=1 timeout "${POOLS_S:-250}" "$PY" -m tools.gdn.pool_probe --iters "${ITERS:-15}" \
        --json "$OUT/decode_tuner_pools.json" 2>&1 | grep -v -i warn | tee "$OUT/decode_tuner_pools.txt"
fi
if [ "${TESTS:-1}" != 0 ]; then
    # TEST_SHARD=i/n: every n-th GPU test from the i-th (1-based) of the collected order, so that the whole suite
    # (203 tests, about 9.5 minutes on an H200 in the eleventh session) fits in n calls of one device call's limit.
    tests=(tests/kernels/test_gdn_triton.py)
    if [ -n "${TEST_SHARD:-}" ]; then
        mapfile -t tests < <("$PY" -m pytest -q --collect-only -m gpu -p no:cacheprovider tests/kernels/test_gdn_triton.py \
            ${TEST_K:+-k "$TEST_K"} 2>/dev/null | "$PY" -c 'import sys
i, n = map(int, sys.argv[1].split("/"))
ids = [l.strip() for l in sys.stdin if "::" in l]
print("\n".join(ids[i - 1::n]))' "$TEST_SHARD")
        echo "shard $TEST_SHARD: ${#tests[@]} tests"
    fi
    # TEST_N=8: eight pytest processes share the GPU and the Triton compiles (pytest-xdist); --durations: where the
    # time went.
    PYTHONUNBUFFERED=1 timeout "${TEST_S:-200}" "$PY" -m pytest -q -m gpu -p no:cacheprovider "${tests[@]}" \
        ${TEST_K:+-k "$TEST_K"} $([ "${TEST_N:-0}" != 0 ] && echo "-n $TEST_N") --durations=15 2>&1 \
        | tee "$OUT/pytest.log" | tail -n 24
    if [ "${TEST_N:-0}" != 0 ]; then
        # Eight processes' caching allocators can take the GPU's memory between them (the fourteenth session: six
        # tests out of memory, all passing alone): every failure is run once more, alone, and both runs are logged.
        # "FAILED <node id> - <message>": an id can hold spaces (decode choices' ids), not " - ".
        mapfile -t failed < <("$PY" -c 'import sys
for line in open(sys.argv[1]):
    if line.startswith("FAILED tests/"):
        print(line[7:].rstrip("\n").split(" - ")[0])' "$OUT/pytest.log")
        if [ "${#failed[@]}" != 0 ]; then
            echo "again, one process: ${#failed[@]} failed"
            PYTHONUNBUFFERED=1 timeout "${RERUN_S:-240}" "$PY" -m pytest -q -m gpu -p no:cacheprovider "${failed[@]}" \
                2>&1 | tee "$OUT/pytest_rerun.log" | tail -n 6
        fi
    fi
fi
if [ "${PROBE:-0}" != 0 ]; then
    # Every chunk schedule / state config and the decode cache hints, with FLA (tools/gdn/schedules.py).
    PYTHONUNBUFFERED=1 timeout "${PROBE_S:-300}" "$PY" -m tools.gdn.schedules --iters "${ITERS:-10}" \
        --json "$OUT/schedules.json" ${PROBE_ONLY:+--only "$PROBE_ONLY"} ${PROBE_SHAPES:+--shapes $PROBE_SHAPES} \
        ${PROBE_QUICK:+--quick} 2>&1 | tee "$OUT/schedules.txt"
    [ "${BENCH:-1}" = 0 ] && exit 0
fi
MAIN=$(mktemp --suffix=.py)
cat >"$MAIN" <<'PYEOF'
import argparse, sys
from hybridkv.benchmarks.gdn import command as bench
p = argparse.ArgumentParser()
bench.register(p)
a = p.parse_args(sys.argv[1:])
sys.exit(a.handler(a))
PYEOF
if [ "${HOSTPROF:-0}" != 0 ]; then  # where each call's host time goes (hybridkv and FLA, cProfile)
    PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" timeout "${HOSTPROF_S:-${BENCH_S:-300}}" "$PY" "$MAIN" --host-profile \
        --iters "${ITERS:-20}" $([ "${NO_FLA:-0}" != 0 ] && echo --no-fla) 2>&1 | tee "$OUT/host_profile.txt"
fi
if [ "${BREAKDOWN:-0}" != 0 ]; then
    PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" timeout "${BENCH_S:-300}" "$PY" "$MAIN" --breakdown --iters "${ITERS:-20}" \
        ${ONLY:+--only "$ONLY"} 2>&1 | tee "$OUT/breakdown.txt"
fi
[ "${BENCH:-1}" = 0 ] && exit 0  # the probes and tests asked for ran; no bench
args=(--iters "${ITERS:-20}")
[ -n "${ONLY:-}" ] && args+=(--only "$ONLY")
if [ "${QLA:-0}" != 0 ] || [ "${FI:-0}" != 0 ]; then
    # The table (hybridkv, FLA's Triton path, FlashQLA or FlashInfer; errors vs the fp32 reference; first calls) to
    # stdout; the JSON file is rewritten after each shape, so a run cut short by the timeout keeps the shapes it
    # finished.
    PYTHONUNBUFFERED=1 PYTHONPATH=".:$PYTHONPATH" timeout "$BENCH_S" "$PY" "$MAIN" "${args[@]}" \
        ${WARM_S:+--warm-timeout "$WARM_S"} --json-file "$OUT/bench_gdn.json" 2>"$OUT/bench_gdn.err" \
        | tee "$OUT/bench_gdn.txt"
    echo "bench rc=${PIPESTATUS[0]}"
    grep -v -i warn "$OUT/bench_gdn.err" | tail -n 12
    exit 0
fi
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" timeout "${BENCH_S:-300}" "$PY" "$MAIN" "${args[@]}" --json \
    >"$OUT/bench_gdn.json" 2>"$OUT/bench_gdn.err"
echo "bench rc=$?"
"$PY" - "$OUT/bench_gdn.json" <<'PYEOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except ValueError as exc:
    sys.exit(f"no bench JSON: {exc}")
print(d["device"], "copy", round(d["copy_gbps"]), "GB/s")
for r in d["rows"]:
    fla = "-" if r["fla_ms"] is None else f"{r['fla_ms']:.3f}"
    x = "-" if r["speedup_vs_fla"] is None else f"{r['speedup_vs_fla']:.2f}"
    host = "" if r.get("host_ms") is None else f"  host {r['host_ms']:.3f}"
    if r.get("fla_host_ms") is not None:
        host += f" / FLA {r['fla_host_ms']:.3f}"
    copy = "" if r.get("copy_pct") is None else f"  {r['copy_pct']:.1f}% copy, {r['copy_same_pct']:.1f}% same-size"
    print(f"{r['kind']:14} {r['shape']:34} {r['ms']:8.3f} ms  FLA {fla:>7}  x{x}{host}{copy}")
PYEOF
