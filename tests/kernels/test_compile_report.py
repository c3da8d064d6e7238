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
    want = {(s.name, ln.label, ln.num_warps) for s in cr._specs() for ln in s.launches}
    assert set(hopper) == want


def test_every_kernel_compiles_for_blackwell():
    for spec in cr._specs():
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
    # A pipelined call's chain (one program per SM, nothing to hide a stall behind) keeps copies
    # in flight across chunks: at two stages it waited out a load latency every chunk (35B 1x8192
    # state kernel 414 us there, 351 at three stages).
    segments = [r for r in states if r.launch.startswith("segment")]
    assert segments and all(r.copies_in_flight > 0 for r in segments), segments
    chains = [r for r in hopper.values() if r.kernel == "chunk_chain" and r.num_stages >= 3]
    assert chains and any(r.launch.startswith("segment") for r in chains)
    assert all(r.copies_in_flight > 0 for r in chains), chains
    inverse = [r for r in hopper.values() if r.kernel == "chunk_inverse"]
    assert inverse and all(r.mma > 0 for r in inverse)


def test_bandwidth_bound_kernels_do_not_spill(hopper):
    for r in hopper.values():
        if r.kernel in ("decode", "recurrent_prefill", "conv_prefill", "conv_state", "conv_update"):
            assert r.spill_bytes == 0, r


def test_a_spec_that_drifts_from_its_kernel_is_named():
    spec = cr._specs()[0]
    broken = cr.KernelSpec(name=spec.name, module=spec.module, attr=spec.attr,
                           signature={k: v for k, v in spec.signature.items() if k != "scale"},
                           constants=spec.constants, aligned=spec.aligned, launches=spec.launches)
    with pytest.raises(ValueError, match=r"chunk_inverse: spec does not match .*missing \['scale'\]"):
        cr.compile_one(broken, spec.launches[0], cr.Arch.HOPPER)


def test_the_pipelined_config_of_fp32_inputs_fits_in_shared_memory():
    """The config a pipelined call picks for 4-byte inputs compiles within the H200's 227 KB per program;
    three stages would not (243.5 KB), which is why fp32 calls get two."""
    from hybridkv.kernels.gdn import triton_chunk

    spec = next(s for s in cr._specs() if s.name == "chunk_state")
    fp32 = cr.KernelSpec(name=spec.name, module=spec.module, attr=spec.attr,
                         signature={k: ("*fp32" if t.startswith("*bf16") else t) for k, t in spec.signature.items()},
                         constants=spec.constants, aligned=spec.aligned, launches=spec.launches)
    bv, warps, stages = triton_chunk._plan(1, 32, 128, 132, 128, itemsize=4).config

    def smem(st):
        launch = cr.Launch(label="fp32 segment", num_warps=warps, num_stages=st,
                           constants={"BV": bv, "SEGMENTED": True, "SCORES_IN": False})
        return cr.compile_one(fp32, launch, cr.Arch.HOPPER).shared_bytes

    assert smem(stages) <= 227 * 1024
    assert smem(3) > 227 * 1024
