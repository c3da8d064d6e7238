#!/usr/bin/env bash
# Nsight Compute on the TMA decode walk where it misses issue #23's decode goal: 35B (H=16, HV=32) bf16 state at 64
# sequences (no pads: the bench's case). Four launches: the shipped config (64, 4, 4, 3) with its TMA store; the same
# walk storing from registers (`Store.DIRECT`, capped at 128 registers so that four programs fit an SM); the probe's
# walk with its row reductions on the tensor cores (`decode_probe._decode_tma_mma`, capped at 128); the Gluon walk with
# its layout written out and the direct store (`gluon_decode_direct`, (64, 4, 4, 3)). Every section of the full set
# (speed of light, memory tables, warp stalls per source line, launch and occupancy, PM sampling where this ncu has
# it) into $OUT/ncu_decode.txt, the report itself into $OUT/ncu_decode.ncu-rep, and the lines that say where the time
# goes printed. The copy the bench divides by is a cudaMemcpy, which ncu does not profile: compare durations with
# the probe's same-size copy (results/decode_probe_b64_h200.txt), not here.
#   bash tools/device/ncu_decode.sh      # on the device, from the repo root (carry [".whl"] is not needed)
#   NCU_RING=1 bash tools/device/ncu_decode.sh   # instead: the shipped walk and the Gluon ring walk, 64 and 256
#                                                    # sequences; the stall table is in $OUT/ncu_decode_stalls.txt
#                                                    # (NCU_CLOCK=none: unlocked clocks)
#   NCU_PREFETCH=1 bash tools/device/ncu_decode.sh  # instead: the shipped prefetching row loop at 35B bf16, 64
#                                                        # sequences, and decode_regs.py's constant-q/k and store-back
#                                                        # ablations of it (unlocked clocks unless NCU_CLOCK=base)
set -u
OUT=${OUT:-/tmp/hybridkv_ncu_out}
mkdir -p "$OUT"
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
echo "ncu: ${ncu:-not found} $("${ncu:-true}" --version 2>/dev/null | tail -n 1)"
[ -n "$ncu" ] || exit 0
sections=$("$ncu" --list-sections 2>/dev/null | awk '{print $1}')
extra=""
grep -qx PmSampling <<<"$sections" && extra="--section PmSampling"
if [ "${NCU_PREFETCH:-0}" != 0 ]; then
    # Issue #23's one missed decode goal as it ships since the fourteenth session: the register-prefetching row loop
    # (4, 128, 1 warp) at 35B bf16, 64 sequences, beside the same loop with q, k and the gates as constants (no loads,
    # no norms) and with each block stored back unchanged (the memory pattern alone), tools/gdn/decode_regs.py's
    # ablations. At the bench's clocks (NCU_CLOCK=base: ncu's default lock).
    timeout "${NCU_S:-200}" "$ncu" -k "regex:_decode_prefetch_kernel|_decode_regs_kernel" -c 3 --set full $extra \
        --import-source yes --clock-control "${NCU_CLOCK:-none}" -o "$OUT/ncu_decode" -f "${PYTHON:-python3}" -c "
import torch
from tools.gdn.schedules import decode_inputs
from tools.gdn import decode_regs
from hybridkv.kernels.gdn import triton_decode_prefetch as p
q, k, v, a, b, A_log, dt_bias, pool, idx = decode_inputs(64, 16, 32, torch.bfloat16)
o = torch.empty_like(v)
print('profiled launches: prefetch (4, 128, 1); the same with constant q, k, gates; the same storing blocks unchanged',
      flush=True)
p.launch((4, 128, 1), q, k, v, a, b, A_log, dt_bias, o, pool, idx, 128**-0.5, True, 1.0, 20.0)
decode_regs.launch((4, 128, 1, 2, 2), q, k, v, a, b, A_log, dt_bias, o, pool, idx, 128**-0.5, const_qk=True)
decode_regs.launch((4, 128, 1, 2, 2), q, k, v, a, b, A_log, dt_bias, o, pool, idx, 128**-0.5, touch=True)
torch.cuda.synchronize()
" >"$OUT/ncu_run.txt" 2>&1
elif [ "${NCU_RING:-0}" != 0 ]; then
    # The shipped walk (64, 4, 4, 3) beside the Gluon ring walk (tools/gdn/gluon_decode_ring.py, (64, 4, 3, 3), q/k/v
    # by TMA and by loads), at 64 and 256 sequences: where the ring's time goes (its fixed part is half the shipped
    # walk's, its us/MB 8-10% more). NCU_CLOCK=none profiles at the clocks the bench runs at (ncu locks the SM clock
    # at base by default, and there the ring was the faster of the two).
    timeout "${NCU_S:-200}" "$ncu" -k "regex:decode_tma|_ring_kernel" -c 6 --set full $extra --import-source yes \
        --clock-control "${NCU_CLOCK:-base}" -o "$OUT/ncu_decode" -f "${PYTHON:-python3}" -c "
import torch
from tools.gdn.schedules import decode_inputs
from tools.gdn import gluon_decode_ring
from hybridkv.kernels.gdn import triton_decode_tma as t
for n in (64, 256):
    q, k, v, a, b, A_log, dt_bias, pool, idx = decode_inputs(n, 16, 32, torch.bfloat16)
    o = torch.empty_like(v)
    print(f'profiled launches: shipped walk, ring walk (64, 4, 3, 3) with q/k/v by TMA, then by loads; {n} sequences',
          flush=True)
    t.launch((64, 4, 4, 3), q, k, v, a, b, A_log, dt_bias, o, pool, idx, 128**-0.5, True, 1.0, 20.0)
    gluon_decode_ring.launch((64, 4, 3, 3), q, k, v, a, b, A_log, dt_bias, o, pool, idx)
    gluon_decode_ring.launch((64, 4, 3, 3), q, k, v, a, b, A_log, dt_bias, o, pool, idx, qkv_tma=False)
torch.cuda.synchronize()
" >"$OUT/ncu_run.txt" 2>&1
else
timeout "${NCU_S:-200}" "$ncu" -k "regex:decode_tma|_decode_kernel" -c 4 --set full $extra --import-source yes \
    -o "$OUT/ncu_decode" -f "${PYTHON:-python3}" -c "
import torch
from tools.gdn.schedules import decode_inputs
from tools.gdn import decode_probe
from hybridkv.kernels.gdn import triton_decode_tma as t
q, k, v, a, b, A_log, dt_bias, pool, idx = decode_inputs(64, 16, 32, torch.bfloat16)
o = torch.empty_like(v)
runs = [('tma store', dict()), ('direct store, maxnreg 128', dict(store=t.Store.DIRECT, maxnreg=128))]
for i, (name, kw) in enumerate(runs):
    print(f'profiled launch {i + 1}: {name}', flush=True)
    t.launch((64, 4, 4, 3), q, k, v, a, b, A_log, dt_bias, o, pool, idx, 128**-0.5, True, 1.0, 20.0, **kw)
print('profiled launch 3: reductions on the tensor cores, maxnreg 128', flush=True)
decode_probe.launch_tma_mma((64, 4, 4, 3), q, k, v, a, b, A_log, dt_bias, o, pool, idx, maxnreg=128)
print('profiled launch 4: Gluon walk, direct store', flush=True)
from tools.gdn import gluon_decode_direct
gluon_decode_direct.launch((64, 4, 4, 3), q, k, v, a, b, A_log, dt_bias, o, pool, idx)
torch.cuda.synchronize()
" >"$OUT/ncu_run.txt" 2>&1
fi
tail -n 5 "$OUT/ncu_run.txt"
"$ncu" --import "$OUT/ncu_decode.ncu-rep" --page details >"$OUT/ncu_decode.txt" 2>&1
"$ncu" --import "$OUT/ncu_decode.ncu-rep" --page source --csv --print-source sass \
    >"$OUT/ncu_decode_sass.csv" 2>/dev/null
# Each launch's stall reasons, cycles per issued instruction (the warp state table the details page only summarises).
"$ncu" --import "$OUT/ncu_decode.ncu-rep" --page raw --print-metric-instances none \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio$,gpu__time_duration.sum,\
smsp__inst_executed.sum,smsp__warps_eligible.avg.per_cycle_active,dram__bytes_read.sum,dram__bytes_write.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,\
lts__t_sector_hit_rate.pct,sm__cycles_elapsed.avg.per_second" >"$OUT/ncu_decode_stalls.txt" 2>&1
[ -n "$extra" ] && "$ncu" --import "$OUT/ncu_decode.ncu-rep" --page raw --print-metric-instances values \
    --metrics "regex:pmsampling:.*(dram|throughput|warps_active)" >"$OUT/ncu_decode_pm.txt" 2>&1
grep -i -E "decode_tma|_decode_prefetch_kernel|_decode_regs_kernel|duration|dram throughput|memory throughput|elapsed cycles|registers|achieved occupancy|\
theoretical occupancy|block limit|warp cycles per issued|stall|l2 hit|mem busy|max bandwidth|waves" \
    "$OUT/ncu_decode.txt" | head -n 120
ls -la "$OUT"
