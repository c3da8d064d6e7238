#!/usr/bin/env bash
# Nsight Compute on the Gluon inverse (issue #23), on the device: one 397B 4x8192 serial call; throughput,
# shared-memory bank conflicts, warp stalls and occupancy, into $OUT/ncu.txt (the lines that say where the time goes
# are printed). Its first run (2026-12-02) compared the shared buffers unpadded and padded: results in
# benchmarks/gdn/README.md.
set -u
OUT=${OUT:-/tmp/hybridkv_ncu_out}
mkdir -p "$OUT"
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
echo "ncu: ${ncu:-not found}"
[ -n "$ncu" ] || exit 0
timeout "${NCU_S:-150}" "$ncu" -k regex:gluon_inverse -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section ComputeWorkloadAnalysis \
    "${PYTHON:-python3}" -c "
from hybridkv.kernels.gdn import bench_cases, triton_chunk
for shape, B, T, H, HV, args, kw in bench_cases._prefill_cases():
    if shape.startswith('397B') and '4x8192' in shape:
        triton_chunk.chunk_gated_delta_rule_fwd(*args, 128**-0.5, None, True, kw['cu_seqlens'], True, False,
                                                schedule=triton_chunk.Schedule.SERIAL)
        break
" >"$OUT/ncu.txt" 2>&1
grep -v -i warn "$OUT/ncu.txt" | grep -i -E "gluon_inverse|bank|throughput|stall|issue|eligible|occupancy|duration|shared|pipe" \
    | head -n 120
