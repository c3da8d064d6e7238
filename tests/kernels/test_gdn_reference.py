"""CPU: the GDN references against a plain per-token recurrence written in the paper's notation."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from hybridkv.kernels.gdn import (  # noqa: E402
    ConvActivation,
    causal_conv1d_fn,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    gated_delta_rule_decode,
)


def plain_recurrence(q, k, v, g, beta, scale, s0, l2):
    """One sequence. q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]; s0 [HV, K, V] or None.

    Paper form with S [V, K]: S_t = a_t S_{t-1} (I - b_t k k^T) + b_t v k^T, o_t = S_t q_t.
    """
    T, H, K = q.shape
    HV, V = v.shape[1:]
    if l2:
        q = q / torch.sqrt((q.double() ** 2).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k.double() ** 2).sum(-1, keepdim=True) + 1e-6)
    S = torch.zeros(HV, V, K, dtype=torch.float64) if s0 is None else s0.double().transpose(-1, -2).clone()
    o = torch.zeros(T, HV, V, dtype=torch.float64)
    eye = torch.eye(K, dtype=torch.float64)
    kx = k.double().repeat_interleave(HV // H, dim=1)
    qx = q.double().repeat_interleave(HV // H, dim=1) * scale
    for t in range(T):
        a, b = torch.exp(g[t].double())[:, None, None], beta[t].double()[:, None, None]
        kk = kx[t][:, :, None] * kx[t][:, None, :]
        S = a * S @ (eye - b * kk) + b * v[t].double()[:, :, None] * kx[t][:, None, :]
        o[t] = (S @ qx[t][:, :, None])[..., 0]
    return o, S.transpose(-1, -2)


def make_inputs(T, H, HV, K=16, V=16, B=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen) + 2.0)
    beta = torch.rand(B, T, HV, generator=gen)
    return q, k, v, g, beta


def expected(q, k, v, g, beta, s0, cu, l2, scale):
    spans = [(b, 0, q.shape[1]) for b in range(q.shape[0])] if cu is None else [
        (0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)
    ]
    o = torch.zeros(*v.shape, dtype=torch.float64)
    states = []
    for n, (b, s, e) in enumerate(spans):
        o[b, s:e], st = plain_recurrence(q[b, s:e], k[b, s:e], v[b, s:e], g[b, s:e], beta[b, s:e], scale,
                                         None if s0 is None else s0[n], l2)
        states.append(st)
    return o, torch.stack(states)


CASES = [
    pytest.param(dict(T=64, H=2, HV=2), id="one-chunk"),
    pytest.param(dict(T=100, H=1, HV=4), id="gva4-T100"),
    pytest.param(dict(T=130, H=2, HV=4, B=2), id="batch2-T130"),
    pytest.param(dict(T=7, H=2, HV=2), id="short-T7"),
]


@pytest.mark.parametrize("entry", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule],
                         ids=["chunk", "recurrent"])
@pytest.mark.parametrize("shape", CASES)
@pytest.mark.parametrize(("l2", "with_state"), [(False, False), (True, True), (False, True)],
                         ids=["raw-zero-h0", "l2norm-h0", "raw-h0"])
def test_rule_matches_plain_recurrence(entry, shape, l2, with_state):
    B = shape.get("B", 1)
    q, k, v, g, beta = make_inputs(shape["T"], shape["H"], shape["HV"], B=B)
    s0 = torch.randn(B, shape["HV"], 16, 16) * 0.5 if with_state else None
    o, st = entry(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                  use_qk_l2norm_in_kernel=l2)
    o_ref, st_ref = expected(q, k, v, g, beta, s0, None, l2, 16**-0.5)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(st.double(), st_ref, rtol=1e-4, atol=1e-4)
    assert st.dtype == torch.float32


@pytest.mark.parametrize("entry", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule],
                         ids=["chunk", "recurrent"])
def test_varlen_matches_per_sequence(entry):
    lens = [1, 63, 64, 65, 150, 0, 9]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v, g, beta = make_inputs(cu[-1], 2, 4, seed=1)
    s0 = torch.randn(len(lens), 4, 16, 16)
    o, st = entry(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                  cu_seqlens=torch.tensor(cu), use_qk_l2norm_in_kernel=True)
    o_ref, st_ref = expected(q, k, v, g, beta, s0, cu, True, 16**-0.5)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(st.double(), st_ref, rtol=1e-4, atol=1e-4)


def test_state_v_first_is_the_transposed_layout():
    q, k, v, g, beta = make_inputs(70, 2, 2)
    s0 = torch.randn(1, 2, 16, 16)
    o, st = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o_t, st_t = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0.transpose(-1, -2).contiguous(),
                                       output_final_state=True, state_v_first=True)
    torch.testing.assert_close(o_t, o)
    torch.testing.assert_close(st_t, st.transpose(-1, -2))


def test_recurrent_defaults_are_no_decay_and_unit_beta():
    q, k, v, _, _ = make_inputs(20, 1, 2)
    o, _ = fused_recurrent_gated_delta_rule(q, k, v)
    o_ref, _ = expected(q, k, v, torch.zeros(1, 20, 2), torch.ones(1, 20, 2), None, None, False, 0.25)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-4)


def test_decode_updates_slots_in_place_and_skips_pads():
    N, H, HV, K, V, slots = 5, 2, 4, 16, 16, 8
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(N, H, K, generator=gen), torch.randn(N, H, K, generator=gen)
    v = torch.randn(N, HV, V, generator=gen)
    a, b = torch.randn(N, HV, generator=gen), torch.randn(N, HV, generator=gen)
    A_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    pool = torch.randn(slots, HV, V, K, generator=gen)
    before = pool.clone()
    idx = torch.tensor([6, -1, 0, 3, -1])
    o = gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, pool, idx)
    g = -torch.exp(A_log) * F.softplus(a + dt_bias)
    beta = torch.sigmoid(b)
    for i, slot in enumerate(idx.tolist()):
        if slot < 0:
            assert torch.equal(o[i], torch.zeros(HV, V))
            continue
        o_ref, st_ref = plain_recurrence(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1],
                                         K**-0.5, before[slot].transpose(-1, -2), True)
        torch.testing.assert_close(o[i].double(), o_ref[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[slot].double(), st_ref.transpose(-1, -2), rtol=1e-4, atol=1e-4)
    untouched = [s for s in range(slots) if s not in idx.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_decode_rejects_repeated_and_out_of_range_slots():
    q = torch.zeros(2, 1, 4)
    v = torch.zeros(2, 1, 4)
    ab = torch.zeros(2, 1)
    pool = torch.zeros(3, 1, 4, 4)
    args = (q, q, v, ab, ab, torch.zeros(1), torch.zeros(1), pool)
    with pytest.raises(ValueError, match="repeats a slot"):
        gated_delta_rule_decode(*args, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"\[-1, 3\)"):
        gated_delta_rule_decode(*args, torch.tensor([0, 3]))


def test_rule_rejects_bad_shapes():
    q, k, v, g, beta = make_inputs(10, 2, 3)
    with pytest.raises(ValueError, match="multiple of key heads"):
        chunk_gated_delta_rule(q, k, v, g, beta)
    q, k, v, g, beta = make_inputs(10, 2, 4, B=2)
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 10]))


def plain_conv(x, weight, bias, init):
    """x [T, D], init [D, W - 1] -> y [T, D], new state [D, W - 1]; SiLU applied."""
    W = weight.shape[1]
    hist = torch.cat([init.t(), x])
    y = torch.stack([
        sum(weight[:, w] * hist[t + w] for w in range(W)) + bias for t in range(x.shape[0])
    ])
    return F.silu(y), hist[-(W - 1):].t()


def test_conv1d_prefill_and_update_on_slots():
    D, W, slots = 12, 4, 6
    gen = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    lens = [5, 1, 9, 2]
    cu = torch.tensor([0, 5, 6, 15, 17])
    x = torch.randn(17, D, generator=gen)
    pool = torch.randn(slots, D, W - 1, generator=gen)
    before = pool.clone()
    idx = torch.tensor([4, 1, -1, 0])
    has_init = torch.tensor([True, False, True, True])
    y = causal_conv1d_fn(x, weight, bias, cu_seqlens=cu, conv_state=pool, state_indices=idx,
                         has_initial_state=has_init)
    for i, n in enumerate(lens):
        s, e = int(cu[i]), int(cu[i + 1])
        slot = int(idx[i])
        init = before[slot] if (slot >= 0 and has_init[i]) else torch.zeros(D, W - 1)
        y_ref, st_ref = plain_conv(x[s:e], weight, bias, init)
        torch.testing.assert_close(y[s:e], y_ref, rtol=1e-5, atol=1e-5)
        if slot >= 0:
            torch.testing.assert_close(pool[slot], st_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(pool[[2, 3, 5]], before[[2, 3, 5]])

    # Decode continues from the states prefill left.
    after_prefill = pool.clone()
    xt = torch.randn(3, D, generator=gen)
    upd = torch.tensor([0, -1, 4])
    yt = causal_conv1d_update(xt, pool, weight, bias, state_indices=upd, activation=ConvActivation.SILU)
    for i, slot in enumerate(upd.tolist()):
        if slot < 0:
            assert torch.equal(yt[i], torch.zeros(D))
            continue
        y_ref, st_ref = plain_conv(xt[i:i + 1], weight, bias, after_prefill[slot])
        torch.testing.assert_close(yt[i], y_ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[slot], st_ref)
