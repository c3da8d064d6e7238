"""Device probe for issues #8 and #23: the inverse kernel's variants (now the shipped Triton kernel and the Gluon
kernel) and the chain's (Triton, Gluon) in serial calls on the bench's prefill shapes, with the per-kernel device
time of each (torch.profiler), and every variant's error on the worst case. Earlier variants (warps, stages, the
product form, precisions, a register cap, the substitution built as T): their numbers are in
tools/gdn/README.md, their code in git history.

    python -m tools.gdn.inverse_probe [--iters 10] [--json PATH] [--shapes 4x8192]

Each variant's output and final state are compared with the pure-torch reference in fp32 (relative
RMS error), so a variant that is fast because it is imprecise shows. Run from the repository root on
a CUDA machine.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from hybridkv.kernels.gdn import bench_timing, breakdown, chunk_plan, reference, triton_chunk
from hybridkv.kernels.gdn.triton_chunk_inverse import GLUON_INVERSE_CONFIG, InverseConfig

from tools.gdn.schedules import probe_args, reference_cases, rel

# Measured on 2026-12-02 (tools/device/results/inverse_probe_cap_h200.txt): the Gluon inverse under a register
# cap (ptxas `maxnreg` 168, 128, 96; g1, g2, g4) was slower at every cap although more programs fit an SM, and its
# shared buffers padded against bank conflicts took 397B 4x8192 595 -> 454 us (Nsight Compute: shared-memory bound,
# tools/device/ncu_gdn.sh); the Triton inverse and the Gluon one at one value head per program are slower
# (inverse_probe_rows_h200.txt); the batch chain's row scales staged by TMA were mixed (chain_probe_staged_h200.txt).
# (inverse, Gluon chain or None) pairs, all serial calls. Earlier variants (the stacked kernel, the chain's other
# forms): tools/gdn/README.md.
GLUON_INVERSE = GLUON_INVERSE_CONFIG
# Sixth session (2026-12-03): the Gluon inverse with all of k and q loaded before the gram (`loads_ahead`), against the
# shipped one, both before the batch plan's chain.
VARIANTS = (
    (dataclasses.replace(GLUON_INVERSE, loads_ahead=False, scores=False), chunk_plan.BATCH_GLUON_CHAIN),
    (dataclasses.replace(GLUON_INVERSE, loads_ahead=True), chunk_plan.BATCH_GLUON_CHAIN),
)


def label(inv: InverseConfig, gluon_chain: triton_chunk.GluonChain | None = None) -> str:
    chain = "" if gluon_chain is None else (f" + gluon chain rows {gluon_chain.rows} overlap {gluon_chain.overlap}"
                                            + (" staged scales" if gluon_chain.staged_scales else ""))
    if inv.gluon:
        cap = "" if inv.maxnreg is None else f" maxnreg {inv.maxnreg}"
        ahead = " loads ahead" if inv.loads_ahead else ""
        return f"gluon g{inv.group} (value heads per program; two warps){ahead}{cap}{chain}"
    return (f"{'stacked ' if inv.stacked else ''}g{inv.group} bkc{inv.bkc} w{inv.warps} s{inv.stages} m{inv.method} "
            f"{inv.prec:6} /{inv.merge_prec:6} reg{inv.maxnreg}{chain}")


def kernel_us(b: breakdown.Breakdown, name: str) -> float:
    return sum(us for k, us in b.kernels if name in k)


def worst_case() -> list[dict]:
    """Every key of a chunk the same, beta = 1, no decay (tests/kernels/test_gdn_triton.py's worst case
    for the inverse; the test allows 5%)."""
    torch.manual_seed(5)
    lens, H, HV = [1000, 300], 2, 4
    T = sum(lens)
    q = torch.randn(1, T, H, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, H, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, T, HV, 128, device="cuda", dtype=torch.bfloat16)
    k = (k[:, :1] + 1e-3 * k).to(k.dtype)
    g, beta = torch.zeros(1, T, HV, device="cuda"), torch.ones(1, T, HV, device="cuda")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    o_ref, s_ref = reference.chunk_reference(q, k, v, g, beta, 128**-0.5, None, True, cu, True)
    rows = []
    for inv, gluon_chain in VARIANTS:
        o, s = triton_chunk.chunk_gated_delta_rule_fwd(q, k, v, g, beta, 128**-0.5, None, True, cu, True, False,
                                                       schedule=triton_chunk.Schedule.SERIAL, inverse=inv,
                                                       gluon_chain=gluon_chain)
        err = (rel(o, o_ref), rel(s, s_ref))
        rows.append(dict(shape="worst case", inverse=repr(inv), gluon_chain=repr(gluon_chain), err=max(err)))
        print(f"worst case {label(inv, gluon_chain)}: o {err[0]:.2e} state {err[1]:.2e}", flush=True)
    return rows


def main() -> int:
    a = probe_args(__doc__)
    rows = []
    print(torch.cuda.get_device_name(), flush=True)
    rows += worst_case()
    for shape, args, kw, o_ref, s_ref in reference_cases(a.shapes):
        q, k, v, g, beta = args
        cu = kw["cu_seqlens"]

        def call(inverse, gluon_chain):  # noqa: B023
            return triton_chunk.chunk_gated_delta_rule_fwd(q, k, v, g, beta, 128**-0.5, None, True, cu, True, False,
                                                           schedule=triton_chunk.Schedule.SERIAL, inverse=inverse,
                                                           gluon_chain=gluon_chain)

        for inv, gluon_chain in VARIANTS:
            name = label(inv, gluon_chain)
            try:
                o, s = call(inv, gluon_chain)
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result too
                print(f"{shape:30} {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            err = max(rel(o, o_ref), rel(s, s_ref))
            b = breakdown.measure("hybridkv", lambda: call(inv, gluon_chain), a.iters,  # noqa: B023
                                  bench_timing._median_ms)
            row = dict(shape=shape, inverse=repr(inv), gluon_chain=repr(gluon_chain), call_us=b.call_us,
                       inverse_us=kernel_us(b, "inverse"), state_us=kernel_us(b, "state") + kernel_us(b, "gluon_chain"),
                       err=err)
            rows.append(row)
            print(f"{shape:30} {name}: call {b.call_us:7.1f} us  "
                  f"inverse {row['inverse_us']:7.1f}  chain {row['state_us']:7.1f}  err {err:.2e}", flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
