"""CPU: every Triton kernel compiles for Hopper and Blackwell (no GPU: Triton's own ptxas), and keeps what
its speed rests on: tensor-core GEMMs and pipelined loads where it has them, no spills where it has none."""

from __future__ import annotations

import pytest

pytest.importorskip("triton.backends.nvidia")

from hybridkv.kernels.gdn import compile_report as cr  # noqa: E402


@pytest.fixture(scope="module")
def hopper() -> dict[tuple[str, str, int], cr.Report]:
    return {(r.kernel, r.launch, r.num_warps): r for r in cr.reports((cr.Arch.HOPPER,))}


def test_every_launch_compiles_for_hopper(hopper):
    want = {(s.name, ln.label, ln.num_warps) for s in cr._specs() for ln in s.launches if cr.Arch.HOPPER in s.archs}
    assert set(hopper) == want


def test_every_kernel_compiles_for_blackwell():
    for spec in (s for s in cr._specs() if cr.Arch.BLACKWELL in s.archs):
        r = cr.compile_one(spec, spec.launches[0], cr.Arch.BLACKWELL)
        assert r.arch == 100 and r.registers > 0
        if spec.name.startswith("chunk_state"):
            assert r.mma_kind == "tcgen05" and r.mma > 0


def test_chunk_kernels_keep_tensor_cores_and_pipelined_loads(hopper):
    states = [r for r in hopper.values() if r.kernel == "chunk_state"]
    assert states
    for r in states:
        assert r.mma_kind == "wgmma" and r.mma > 0, r
        if r.num_stages >= 2:
            assert r.async_copies > 0, f"{r}: the next chunk's loads are no longer prefetched"
    # A one-sequence chain (one program per SM, nothing to hide a stall behind: the pipelined segments
    # and 397B's serial scores config) keeps copies in flight across chunks: at two stages it waited out
    # a load latency every chunk (35B 1x8192 state kernel 414 us there, 351 at three stages).
    deep = [r for r in states if r.num_stages >= 3]
    assert any(r.launch.startswith("segment") for r in deep) and any("scores" in r.launch for r in deep)
    assert all(r.copies_in_flight > 0 for r in deep), deep
    chains = [r for r in hopper.values() if r.kernel == "chunk_chain" and r.num_stages >= 3]
    assert chains and any(r.launch.startswith("segment") for r in chains)
    assert all(r.copies_in_flight > 0 for r in chains), chains
    for name in ("chunk_inverse", "chunk_scores"):
        parallel = [r for r in hopper.values() if r.kernel == name]
        assert parallel and all(r.mma > 0 for r in parallel), name


def test_the_gluon_inverse_keeps_its_substitution_in_threads(hopper):
    """What the Gluon inverse is for: the same outputs as the Triton kernel (one value head per program) without the
    lane crossings of its substitution. Offline sm_90 on 2026-12-02: 88 shuffles and 65 barriers in the PTX, 156
    registers (252 with groups of four), no spills; the Triton kernel for one value head: 1,264 and 139."""
    triton_one_head = hopper[("chunk_inverse", "default group=1", 2)]
    for grp in (1, 4):  # a value head per program, or four sharing their key head's gram (252 registers)
        gluon = hopper[("chunk_inverse_gluon", f"default group={grp}", 2)]
        assert gluon.spill_bytes == 0 and gluon.mma_kind == "mma.sync" and gluon.mma > 0, gluon
        assert gluon.shuffles * 4 < triton_one_head.shuffles, (gluon, triton_one_head)
        assert gluon.barriers < triton_one_head.barriers, (gluon, triton_one_head)


def test_the_gluon_chain_keeps_the_state_in_registers(hopper):
    """What the Gluon chain is for: every product on wgmma with the state as the register operand (no shared-memory
    copy of it), TMA copies two chunks deep, no spills. Offline sm_90 on 2026-12-02: 255 registers, 120 KB of shared
    memory (one program per SM), 36 wgmma in the PTX."""
    chain = hopper[("chunk_chain_gluon", "default", 8)]
    assert chain.spill_bytes == 0 and chain.mma_kind == "wgmma" and chain.mma > 0, chain
    assert chain.async_copies > 0, chain  # the TMA copies of q, k, v and T


def test_bandwidth_bound_kernels_do_not_spill(hopper):
    for r in hopper.values():
        if r.kernel in ("decode", "decode_tma", "decode_rows", "decode_prefetch", "recurrent_prefill", "conv_prefill",
                        "conv_state", "conv_update"):
            assert r.spill_bytes == 0, r


def test_a_spec_that_drifts_from_its_kernel_is_named():
    spec = cr._specs()[0]
    broken = cr.KernelSpec(name=spec.name, module=spec.module, attr=spec.attr,
                           signature={k: v for k, v in spec.signature.items() if k != "scale"},
                           constants=spec.constants, aligned=spec.aligned, launches=spec.launches)
    with pytest.raises(ValueError, match=r"chunk_inverse: spec does not match .*missing \['scale'\]"):
        cr.compile_one(broken, spec.launches[0], cr.Arch.HOPPER)


def _fp32_state_smem(bv: int, warps: int, stages: int, scores: bool) -> int:
    spec = next(s for s in cr._specs() if s.name == "chunk_state")
    fp32 = cr.KernelSpec(name=spec.name, module=spec.module, attr=spec.attr,
                         signature={k: ("*fp32" if t.startswith("*bf16") else t) for k, t in spec.signature.items()},
                         constants=spec.constants, aligned=spec.aligned, launches=spec.launches)
    launch = cr.Launch(label="fp32 segment", num_warps=warps, num_stages=stages,
                       constants={"BV": bv, "SEGMENTED": True, "SCORES_IN": scores})
    return cr.compile_one(fp32, launch, cr.Arch.HOPPER).shared_bytes


def test_the_pipelined_plan_of_fp32_inputs_fits_in_shared_memory():
    """The plan of a one-sequence call with 4-byte inputs compiles within the H200's 227 KB per program;
    three stages would not (the fused chain needs 243.5 KB there), which is why fp32 calls get two; and
    the scores form at BV=64 would not fit even at two, which is why fp32 has no BV=64 plan."""
    from hybridkv.kernels.gdn import chunk_plan, triton_chunk

    plan = chunk_plan.plan(1, 32, 128, 128, 132, 128, itemsize=4)
    bv, warps, stages = plan.config
    scores = plan.form is triton_chunk.Form.SCORES
    assert _fp32_state_smem(bv, warps, stages, scores) <= 227 * 1024
    assert _fp32_state_smem(bv, warps, 3, False) > 227 * 1024
    assert _fp32_state_smem(64, 4, 2, True) > 227 * 1024


def test_the_row_looped_decode_keeps_few_registers_and_pipelined_loads(hopper):
    """What `triton_decode_rows` is for: few registers a thread, so many programs share an SM, and its [BV, K] state
    loads turned into cp.async a stage ahead. Offline sm_90 on 2026-12-04: 32-72 registers, no spills (the TMA walk:
    128)."""
    rows = [r for r in hopper.values() if r.kernel == "decode_rows"]
    assert rows
    for r in rows:
        assert r.registers <= 80 and r.spill_bytes == 0 and r.async_copies > 0, r


def test_the_prefetching_decode_keeps_its_loads_in_registers(hopper):
    """What `triton_decode_prefetch` is for: its blocks prefetched into registers, so no cp.async and no shared-memory
    staging of the state (a few hundred bytes for the output row's layout change), few enough registers for many
    programs a SM. Offline sm_90 on 2026-12-04: 56-86 registers, no spills."""
    pre = [r for r in hopper.values() if r.kernel == "decode_prefetch"]
    assert pre
    for r in pre:
        assert r.registers <= 96 and r.spill_bytes == 0 and r.async_copies == 0 and r.shared_bytes <= 1024, r


def test_the_loop_of_a_sass_listing_is_found_and_counted():
    listing = """
        /*0100*/                   MOV R1, c[0x0][0x28] ;
        /*0110*/                   FFMA.FTZ R2, R3, R4, R5 ;
        /*0120*/               @P0 SHFL.BFLY PT, R6, R2, 0x1, 0x1f ;
        /*0130*/              @!P1 BRA 0x110 ;
        /*0140*/                   EXIT ;
        /*0150*/                   BRA 0x150;
"""
    n, ops = cr.loop_mix(listing)
    assert n == 3 and ops == {"FFMA": 1, "SHFL": 1, "BRA": 1}
    with pytest.raises(ValueError, match="no loop"):
        cr.loop_mix("        /*0100*/                   EXIT ;\n")


def test_the_prefetching_decode_loop_stays_near_190_instructions_a_block():
    """The work between two of a warp's loads is what holds the missed decode goal back (Nsight Compute at 35B bf16, 64
    sequences: results/ncu_decode_prefetch_h200.txt), so its size is pinned: the shipped (4, 128, 1 warp) loop, bf16,
    two blocks an iteration, offline sm_90 on 2026-12-04: 380 instructions, 36 SHFL. A change that adds work to the
    loop (a layout conversion, a reload of q or k) fails here before device time is spent on it."""
    spec = next(s for s in cr._specs() if s.name == "decode_prefetch")
    launch = next(la for la in spec.launches if la.label == "bf16 state BV=4 ROWS=128")
    compiled = cr.compiled_kernel(spec, launch, cr.Arch.HOPPER)
    n, ops = cr.loop_mix(cr.sass(compiled.asm["cubin"]))
    assert n <= 400 and ops["SHFL"] <= 36, (n, ops.most_common(8))
