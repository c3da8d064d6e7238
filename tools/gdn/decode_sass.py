"""Offline, on any machine: the SASS of the decode loop per block, for the shipped prefetching kernel and the probe's
variants of it (tools/gdn/decode_regs.py), compiled for sm_90 at 35B's shape (H 16, HV 32, dk = dv = 128).

Why (results/ncu_decode_prefetch_h200.txt): at 35B bf16 with 64 sequences the shipped (4, 128, 1 warp) loop runs 14
warps an SM, each waiting on its own blocks, and the work between two loads (about 190 instructions a block, 18 of them
SHFL: two row sums over 16 lanes for each of a thread's two rows) stretches the time between them; with q, k constant or
no arithmetic at all the same pattern ran 2% and 7% faster. A layout with fewer lanes a row takes fewer shuffles. This
counts what each variant issues a block before device time is spent on it.

    python -m tools.gdn.decode_sass
"""

from __future__ import annotations

from hybridkv.kernels.gdn import compile_report, triton_decode_prefetch
from hybridkv.kernels.gdn.compile_specs import ROW_LOOP, Arch, KernelSpec, Launch

def _variants() -> list[tuple[str, KernelSpec, Launch, int]]:
    """(name, spec, launch, blocks a loop iteration) for each variant."""
    shipped = KernelSpec(name="prefetch", module="hybridkv.kernels.gdn.triton_decode_prefetch",
                         attr="_decode_prefetch_kernel", launches=(), **ROW_LOOP)
    regs = KernelSpec(name="regs", module="tools.gdn.decode_regs", attr="_decode_regs_kernel", launches=(),
                      **{**ROW_LOOP, "constants": {**ROW_LOOP["constants"], "CONST_QK": False, "TOUCH": False,
                                                   "QK_FIRST": True, "STAGGER": 0,
                                                   "L2AHEAD": 0, "L2ALL": False}})
    regs3 = KernelSpec(name="regs3", module="tools.gdn.decode_regs", attr="_decode_regs3_kernel", launches=(),
                       **{**ROW_LOOP, "constants": {**ROW_LOOP["constants"], "STAGGER": 0}})
    out = []
    for dt in ("bf16", "fp32"):
        stream = dt == "bf16"
        for cfg in triton_decode_prefetch.PREFETCH_CONFIGS:
            out.append((f"prefetch {cfg} {dt}", shipped,
                        Launch(label="", num_warps=cfg[2], num_stages=1,
                               constants={"BV": cfg[0], "ROWS": cfg[1], "STREAM": stream, "state": dt,
                                          "L2AHEAD": triton_decode_prefetch.l2_ahead(cfg)}), 2))
        # K held as [K / KC, KC]: a row's sums cross KC / 8 lanes (bf16), not 16 (launch3 in decode_regs.py).
        for bv, rows, warps, kc in ((4, 128, 1, 64), (4, 128, 1, 32), (8, 128, 2, 64), (8, 128, 4, 32)):
            out.append((f"regs3 ({bv}, {rows}, {warps}, KC {kc}) {dt}", regs3,
                        Launch(label="", num_warps=warps, num_stages=1,
                               constants={"BV": bv, "ROWS": rows, "KC": kc, "STREAM": stream, "state": dt}), 2))
        # The same walks started at a block of their own (STAGGER): what the wrap-around costs a block.
        out.append((f"regs (4, 128, 1, 2, 2) stagger {dt}", regs,
                    Launch(label="", num_warps=1, num_stages=1,
                           constants={"BV": 4, "ROWS": 128, "DEPTH": 2, "UNROLL": 2, "STREAM": stream, "state": dt,
                                      "STAGGER": 1}), 2))
        for extra in ({"L2AHEAD": 8}, {"L2ALL": True}):
            out.append((f"regs (4, 128, 1, 2, 2) {next(iter(extra))} {dt}", regs,
                        Launch(label="", num_warps=1, num_stages=1,
                               constants={"BV": 4, "ROWS": 128, "DEPTH": 2, "UNROLL": 2, "STREAM": stream, "state": dt,
                                          **extra}), 2))
        out.append((f"regs3 (4, 128, 1, KC 32) stagger {dt}", regs3,
                    Launch(label="", num_warps=1, num_stages=1,
                           constants={"BV": 4, "ROWS": 128, "KC": 32, "STREAM": stream, "state": dt, "STAGGER": 1}),
                    2))
        out.append((f"regs (4, 128, 1, 4, 4) {dt}", regs,
                    Launch(label="", num_warps=1, num_stages=1,
                           constants={"BV": 4, "ROWS": 128, "DEPTH": 4, "UNROLL": 4, "STREAM": stream, "state": dt}),
                    4))
    return out


def main() -> None:
    print(f"{'variant':38} {'regs':>4} {'a block':>7} {'SHFL':>5} {'FFMA':>5} {'FMUL':>5} {'FADD':>5} {'cvt':>5} "
          f"{'LDG':>4} {'STG':>4}")
    for name, spec, launch, blocks in _variants():
        compiled = compile_report.compiled_kernel(spec, launch, Arch.HOPPER)
        registers, _ = compile_report._resource_usage(compiled.asm["cubin"])
        n, ops = compile_report.loop_mix(compile_report.sass(compiled.asm["cubin"]))
        cvt = ops["PRMT"] + ops["SHF"] + ops["F2FP"]  # bf16 <-> fp32 unpacking and packing (and some shifts)
        per = {k: ops[k] / blocks for k in ("SHFL", "FFMA", "FMUL", "FADD", "LDG", "STG")}
        print(f"{name:38} {registers:4d} {n / blocks:7.1f} {per['SHFL']:5.1f} {per['FFMA']:5.1f} {per['FMUL']:5.1f} "
              f"{per['FADD']:5.1f} {cvt / blocks:5.1f} {per['LDG']:4.1f} {per['STG']:4.1f}", flush=True)


if __name__ == "__main__":
    main()
