#!/usr/bin/env bash
# Nsight Compute on the GDN prefill kernels on the device: one plain 397B 4x8192 call (the plan's: the
# Gluon inverse, then the batch plan's Gluon chain); throughput, shared-memory bank conflicts, every warp-stall reason
# per issued instruction and occupancy of each launch that NCU_KERNEL matches, into $OUT/ncu.txt (the lines that say
# where the time goes are printed).
set -u
OUT=${OUT:-/tmp/hybridkv_ncu_out}
mkdir -p "$OUT"
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
echo "ncu: ${ncu:-not found}"
[ -n "$ncu" ] || exit 0
timeout "${NCU_S:-150}" "$ncu" -k "regex:${NCU_KERNEL:-gluon_inverse|gluon_chain}" -c 2 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section ComputeWorkloadAnalysis --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    "${PYTHON:-python3}" -c "
from hybridkv.kernels.gdn import chunk_gated_delta_rule
from hybridkv.benchmarks.gdn import cases as bench_cases
for shape, B, T, H, HV, args, kw in bench_cases._prefill_cases():
    if shape.startswith('397B') and '4x8192' in shape:
        chunk_gated_delta_rule(*args, cu_seqlens=kw['cu_seqlens'], use_qk_l2norm_in_kernel=True, output_final_state=True)
        break
" >"$OUT/ncu.txt" 2>&1
grep -v -i warn "$OUT/ncu.txt" | grep -i -E "gluon_|bank|throughput|stall|issue|eligible|occupancy|duration|shared|pipe|ratio" \
    | grep -v -E "ratio +(0(\.0+)?|0\.0[0-4][0-9]*)$" | head -n 150
