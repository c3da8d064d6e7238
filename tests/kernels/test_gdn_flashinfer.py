"""CPU: the FlashInfer column of `hybridkv bench gdn`: why it is empty where FlashInfer cannot run, and the mapping of
hybridkv's (FLA's) arguments to FlashInfer's layouts and back, checked against its documented contract."""

from __future__ import annotations

import re
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from hybridkv.benchmarks.gdn import baselines  # noqa: E402
from hybridkv.benchmarks.gdn import flashinfer_args
from hybridkv.kernels.gdn import naive as reference
from tests.kernels import flashinfer_contract  # noqa: E402


@pytest.fixture
def faked_flashinfer(monkeypatch):
    """An importable `flashinfer` 0.7.2 whose GDN prefill is the contract stand-in."""
    pkg = types.ModuleType("flashinfer")
    pkg.__version__ = "0.7.2"
    prefill = types.ModuleType("flashinfer.gdn_prefill")
    prefill.chunk_gated_delta_rule = flashinfer_contract.chunk_gated_delta_rule
    pkg.gdn_prefill = prefill
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.gdn_prefill", prefill)


def _gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)


def test_loader_says_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    loaded = baselines.load_flashinfer()
    assert loaded.fn is None and loaded.name == "flashinfer"
    assert loaded.note.startswith("not installed (ModuleNotFoundError: import of flashinfer halted")


def test_loader_says_failed_to_import(monkeypatch, tmp_path):
    # Installed, but its import breaks (a CuTe DSL library that does not load, say): the bench goes on without it.
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("raise RuntimeError('No CTK flavor installed')\n")
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = baselines.load_flashinfer()
    assert loaded.fn is None and loaded.note == "failed to import (RuntimeError: No CTK flavor installed)"


def test_loader_says_it_needs_a_hopper_or_newer_gpu(monkeypatch, faked_flashinfer):
    _gpu(monkeypatch, None)
    loaded = baselines.load_flashinfer()
    assert loaded.fn is None
    assert loaded.note == ("flashinfer-python 0.7.2 needs a CUDA GPU of compute capability 9.0 (Hopper) or newer; "
                           "torch sees none here")
    _gpu(monkeypatch, (8, 0))
    assert baselines.load_flashinfer().note == ("flashinfer-python 0.7.2 has GDN prefill kernels for sm9x, sm10x, "
                                                "sm12x only, this GPU is sm80")
    _gpu(monkeypatch, (9, 0))
    loaded = baselines.load_flashinfer()
    assert loaded.fn is not None and loaded.note.startswith("flashinfer-python 0.7.2 (nvidia-cutlass-dsl ")
    assert loaded.note.endswith("), sm90, use_cp=auto")
    assert baselines.flashinfer_gpu_problem((10, 3)) is None and baselines.flashinfer_gpu_problem((12, 0)) is None
    assert baselines.flashinfer_gpu_problem((11, 0)) is not None


def _inputs(B, T, H, HV, *, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, 128, generator=gen).to(dtype)
    k = torch.randn(B, T, H, 128, generator=gen).to(dtype)
    v = torch.randn(B, T, HV, 128, generator=gen).to(dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, generator=gen) + 3.0)  # log decay, as the bench's
    beta = torch.rand(B, T, HV, generator=gen)
    return q, k, v, g, beta


def test_batched_inputs_become_even_sequences_in_flashinfers_layouts():
    q, k, v, g, beta = _inputs(2, 3, 1, 2)
    kw, unpack = flashinfer_args.to_flashinfer(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert unpack == flashinfer_args.Unpack(batch=2, length=3, output_final_state=True)
    assert [tuple(kw[n].shape) for n in ("q", "k", "v", "g", "beta")] == [(6, 1, 128), (6, 1, 128), (6, 2, 128),
                                                                         (6, 2), (6, 2)]
    assert kw["q"].data_ptr() == q.data_ptr() and kw["q"].dtype == torch.bfloat16  # a view, not a copy
    assert kw["g"].dtype == kw["beta"].dtype == torch.float32
    torch.testing.assert_close(kw["g"], g.exp().reshape(6, 2))  # the decay factor itself, not its log
    # Once per g tensor (the bench's timed calls reuse it), again after an in-place change of g.
    assert flashinfer_args.to_flashinfer(q, k, v, g, beta)[0]["g"] is kw["g"]
    g.add_(-0.5)
    again = flashinfer_args.to_flashinfer(q, k, v, g, beta)[0]["g"]
    assert again is not kw["g"]
    torch.testing.assert_close(again, g.exp().reshape(6, 2))
    assert kw["cu_seqlens"].tolist() == [0, 3, 6] and kw["cu_seqlens"].dtype == torch.int32
    assert kw["cu_seqlens"] is flashinfer_args.to_flashinfer(q, k, v, g, beta)[0]["cu_seqlens"]  # built once
    assert kw["max_seqlen"] == 3 and kw["scale"] == 128**-0.5 and kw["initial_state"] is None
    assert kw["use_qk_l2norm_in_kernel"] and kw["output_final_state"]


def test_varlen_keeps_cu_seqlens_and_states_turn_v_before_k():
    q, k, v, g, beta = _inputs(1, 5, 2, 4)
    cu = torch.tensor([0, 2, 5])
    h0 = torch.randn(2, 4, 128, 128)  # FLA's [N, HV, K, V]
    kw, unpack = flashinfer_args.to_flashinfer(q, k, v, g, beta, 0.5, h0, cu_seqlens=cu)
    assert kw["cu_seqlens"] is cu and kw["max_seqlen"] is None and kw["scale"] == 0.5
    assert kw["initial_state"].is_contiguous() and torch.equal(kw["initial_state"], h0.transpose(-1, -2))
    o_fi, state_fi = torch.randn(5, 4, 128), torch.randn(2, 4, 128, 128)  # FlashInfer's [T, HV, V], [N, HV, V, K]
    o, state = flashinfer_args.from_flashinfer((o_fi, state_fi), flashinfer_args.Unpack(batch=1, length=5,
                                                                                         output_final_state=True))
    assert o.shape == (1, 5, 4, 128) and torch.equal(o[0], o_fi)
    assert state.shape == (2, 4, 128, 128) and state[1, 2, 3, 7] == state_fi[1, 2, 7, 3]
    assert flashinfer_args.from_flashinfer(o_fi, unpack)[1] is None  # output_final_state=False: output alone


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: (a[0][..., :64], *a[1:]), "FlashInfer's GDN prefill takes K = V = 128, got K=64, V=128"),
    (lambda a: (a[0].float(), *a[1:]), "FlashInfer's GDN prefill takes bfloat16/float16 q, got float32"),
    (lambda a: (a[0][0], *a[1:]), "q and v must be [B, T, heads, dim], got shapes [3, 1, 128] and [2, 3, 2, 128]"),
])
def test_mapping_refuses_what_flashinfer_cannot_take(change, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        flashinfer_args.to_flashinfer(*change(_inputs(2, 3, 1, 2)))


def test_mapping_refuses_varlen_batches_and_float_offsets():
    q, k, v, g, beta = _inputs(2, 3, 1, 2)
    with pytest.raises(ValueError, match="varlen \\(cu_seqlens given\\) needs batch size 1, got 2"):
        flashinfer_args.to_flashinfer(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=re.escape("cu_seqlens must be a 1-D int32/int64 tensor, got shape [2] dtype "
                                                   "float32")):
        flashinfer_args.to_flashinfer(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0.0, 3.0]))


@pytest.mark.parametrize(("B", "lens"), [(2, None), (1, (7, 0, 4))])
def test_mapped_call_through_the_documented_contract_matches_the_reference(monkeypatch, faked_flashinfer, B, lens):
    """hybridkv's inputs -> FlashInfer's layouts -> a stand-in honouring FlashInfer's documented semantics -> back:
    the same output and final state as hybridkv's fp32 reference, from a given initial state. A log-space g, a
    K-by-V state either way or a wrong scale would each be off by far more than bf16 rounding."""
    _gpu(monkeypatch, (9, 0))
    fn = baselines.load_flashinfer().fn
    T = 6 if lens is None else sum(lens)
    q, k, v, g, beta = _inputs(B, T, 2, 4, seed=3)  # value head h reads key head h // 2 in both
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    h0 = torch.randn(B if lens is None else len(lens), 4, 128, 128, generator=torch.Generator().manual_seed(4)) / 8
    o, state = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                  use_qk_l2norm_in_kernel=True)
    ref_o, ref_state = reference.chunk_reference(q, k, v.float(), g, beta, 128**-0.5, h0, True, cu, True)
    assert o.shape == ref_o.shape and o.dtype == torch.bfloat16
    torch.testing.assert_close(o.float(), ref_o, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------- decode on a pool
def test_decode_loader_says_not_installed_and_needs_hopper(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    loaded = baselines.load_flashinfer_decode()
    assert loaded.fn is None and loaded.name == "flashinfer_decode" and loaded.note.startswith("not installed (")
    pkg = types.ModuleType("flashinfer")
    pkg.__version__ = "0.7.2"
    decode = types.ModuleType("flashinfer.gdn_decode")
    decode.gated_delta_rule_decode_pretranspose = flashinfer_contract.gated_delta_rule_decode_pretranspose
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.gdn_decode", decode)
    _gpu(monkeypatch, (8, 0))
    assert baselines.load_flashinfer_decode().note == ("flashinfer-python 0.7.2's GDN decode needs sm90+, "
                                                       "this GPU: sm80")
    _gpu(monkeypatch, (9, 0))
    loaded = baselines.load_flashinfer_decode()
    assert loaded.fn is not None
    assert loaded.note.startswith("flashinfer-python 0.7.2 gated_delta_rule_decode_pretranspose")


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_decode_call_through_the_documented_contract_matches_the_reference(state_dtype):
    """hybridkv's decode arguments -> FlashInfer's (token axis, bf16 gates, pool + indices) -> a stand-in honouring
    its docstring: the same output and updated slots as `reference.decode_reference`, other slots untouched. A K-by-V
    pool, unmapped indices or gates in the wrong form would each be off by far more than bf16 rounding."""
    gen = torch.Generator().manual_seed(4)
    N, H, HV = 3, 1, 2
    q, k = (torch.randn(N, H, 128, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(N, HV, 128, generator=gen).bfloat16()
    a16, b16 = torch.randn(N, HV, generator=gen).bfloat16(), torch.randn(N, HV, generator=gen).bfloat16()
    A_log, dt_bias = torch.randn(HV, generator=gen) * 0.5, torch.randn(HV, generator=gen) * 0.5
    pool = (torch.randn(6, HV, 128, 128, generator=gen) * 0.1).to(state_dtype)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)  # the bench passes FlashInfer int32 slots, as vLLM does
    want_pool = pool.to(torch.float32, copy=True)
    want = reference.decode_reference(q, k, v, a16.float(), b16.float(), A_log, dt_bias, want_pool, idx, 128**-0.5,
                                      True, True)
    fn = baselines.flashinfer_decode_call(flashinfer_contract.gated_delta_rule_decode_pretranspose)
    got_pool = pool.clone()
    o = fn(q, k, v, a16, b16, A_log, dt_bias, got_pool, idx)
    assert o.shape == (N, HV, 128)
    torch.testing.assert_close(o.float(), want.float(), atol=2e-2, rtol=2e-2)
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_pool[idx].float(), want_pool[idx], atol=tol, rtol=tol)
    untouched = torch.tensor([1, 3, 5])
    assert torch.equal(got_pool[untouched], pool[untouched])
