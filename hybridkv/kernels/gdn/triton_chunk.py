"""Triton chunked gated delta rule (forward), two kernels; `reference.chunk_reference` is its oracle.

1. `_chunk_prep_kernel`, parallel over (chunk, value head): everything that does not depend on the
   state. T = (I + L)^-1 of the decayed, beta-scaled K K^T (16x16 blocks: forward substitution on the
   diagonal, block products below), P = scale (Q K^T masked and decayed), and per-token row scales
   that fold the l2 norms, beta and the decays into the state kernel's GEMM epilogues. They go to
   chunk-aligned scratch (T and P in bf16: 256 B per token and value head, plus 16 B of fp32 scales).
2. `_chunk_state_kernel`, sequential over the chunks of one (sequence, value head, V block) with the
   state in registers. Per chunk only the state-dependent GEMMs run: K S and Q S, V' = T (beta V -
   sk K S), O = sq Q S + P V', S = e^g_last S + K^T (sd V'). Raw q and k go straight into the GEMMs
   (shared by the value heads of a key head, so mostly L2 hits); no w, u, h or v_new in HBM, and no
   GEMM is repeated per V block.

Two measured alternatives to step 2 (`Variant`, kernels in `triton_chunk_split`): SPLIT and WU.
Neither beat the fused kernel on the H200; they stay tested so the next attempt (a context-parallel
scan, warp specialization) starts from their chain/output split.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

BT = 64
_NROW = 4


class Variant(enum.Enum):
    """How the sequential part is cut; all three are tested against the reference and timed side by side.

    Measured on one H200 (`hybridkv bench gdn --variants`, 2026-11-29, Triton 3.6): FUSED was fastest
    or within noise on every Qwen3.5 shape; taking GEMMs off the chain (SPLIT, WU) costs more in scratch
    round trips and launches than it saves on the chain (397B 4x8192: 4.65 / 5.25 / 5.84 ms). SPLIT
    won once on 35B 1x8192 (0.94 vs 1.05 ms) and lost on the rerun (1.04 vs 0.97 ms).
    """

    FUSED = "fused"  # one kernel per (sequence, head, V block): all five GEMMs of a chunk on the chain
    SPLIT = "split"  # chain (K S, T y, K^T V') + a parallel output kernel (Q S, P V')
    WU = "wu"  # W = T sk K and U = T beta V precomputed in parallel: chain V' = U - W S, K^T V' (FLA's cut)  # row scales per token: sq, sk, sd, beta


@triton.jit
def _inv_unit_lower16(L):
    """(I + L)^-1 for a strictly lower 16x16 L, by forward substitution (row i of T reads rows < i)."""
    r = tl.arange(0, 16)
    t = (r[:, None] == r[None, :]).to(tl.float32)
    for i in tl.static_range(1, 16):
        l_row = tl.sum(tl.where(r[:, None] == i, L, 0.0), 0)
        corr = tl.sum(l_row[:, None] * t, 0)
        t = tl.where(r[:, None] == i, t - corr[None, :], t)
    return t


@triton.jit
def _load_sub(k, g, beta, bos, T, i_h, i_hv, row0, H, HV, K: tl.constexpr,
              BK: tl.constexpr, L2NORM: tl.constexpr):
    """One 16-token sub-block: k [16, BK] in k's dtype, g and beta [16] fp32 (zero past the end)."""
    p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (row0, 0), (16, BK), (1, 0))
    b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
    if L2NORM:
        kf = b_k.to(tl.float32)
        kf = kf * tl.rsqrt(tl.sum(kf * kf, 1) + 1e-6)[:, None]
        b_k = kf.to(b_k.dtype)
    o_t = row0 + tl.arange(0, 16)
    m_t = o_t < T
    b_g = tl.load(g + (bos + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_b = tl.load(beta + (bos + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    return b_k, b_g, b_b


@triton.jit
def _lower_block(ki, kj, ci, cj, bi, DIAG: tl.constexpr):
    """L_ij = beta_i e^(gamma_i - gamma_j) k_i . k_j, strictly lower when i == j."""
    a = tl.dot(ki, tl.trans(kj))
    d = ci[:, None] - cj[None, :]
    if DIAG:
        r = tl.arange(0, 16)
        keep = r[:, None] > r[None, :]
        return tl.where(keep, bi[:, None] * tl.exp(tl.where(keep, d, 0.0)) * a, 0.0)
    return bi[:, None] * tl.exp(d) * a


@triton.jit
def _store16(p, x, row0: tl.constexpr, col0: tl.constexpr):
    r = tl.arange(0, 16)
    tl.store(p + (row0 + r)[:, None] * 64 + (col0 + r)[None, :], x.to(p.dtype.element_ty))


@triton.jit
def _chunk_prep_kernel(q, k, g, beta, A, P, R, G, cu_seqlens, chunk_table, scale, H, HV, K: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr):
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_table + 2 * i_c)
    i_t = tl.load(chunk_table + 2 * i_c + 1)
    start = tl.load(cu_seqlens + i_n)
    T = tl.load(cu_seqlens + i_n + 1) - start
    bos = start.to(tl.int64)
    i_h = i_hv // (HV // H)
    r0 = i_t * 64
    k0, g0, b0 = _load_sub(k, g, beta, bos, T, i_h, i_hv, r0, H, HV, K, BK, L2NORM)
    k1, g1, b1 = _load_sub(k, g, beta, bos, T, i_h, i_hv, r0 + 16, H, HV, K, BK, L2NORM)
    k2, g2, b2 = _load_sub(k, g, beta, bos, T, i_h, i_hv, r0 + 32, H, HV, K, BK, L2NORM)
    k3, g3, b3 = _load_sub(k, g, beta, bos, T, i_h, i_hv, r0 + 48, H, HV, K, BK, L2NORM)
    c0 = tl.cumsum(g0, 0)
    c1 = tl.cumsum(g1, 0) + tl.sum(g0, 0)
    c2 = tl.cumsum(g2, 0) + tl.sum(g0, 0) + tl.sum(g1, 0)
    c3 = tl.cumsum(g3, 0) + tl.sum(g0, 0) + tl.sum(g1, 0) + tl.sum(g2, 0)

    t00 = _inv_unit_lower16(_lower_block(k0, k0, c0, c0, b0, True))
    t11 = _inv_unit_lower16(_lower_block(k1, k1, c1, c1, b1, True))
    t22 = _inv_unit_lower16(_lower_block(k2, k2, c2, c2, b2, True))
    t33 = _inv_unit_lower16(_lower_block(k3, k3, c3, c3, b3, True))
    l10 = _lower_block(k1, k0, c1, c0, b1, False)
    l20 = _lower_block(k2, k0, c2, c0, b2, False)
    l21 = _lower_block(k2, k1, c2, c1, b2, False)
    l30 = _lower_block(k3, k0, c3, c0, b3, False)
    l31 = _lower_block(k3, k1, c3, c1, b3, False)
    l32 = _lower_block(k3, k2, c3, c2, b3, False)
    # Block forward substitution: T_ij = -T_ii sum_{j <= m < i} L_im T_mj.
    t10 = -tl.dot(t11, tl.dot(l10, t00, input_precision="ieee"), input_precision="ieee")
    t21 = -tl.dot(t22, tl.dot(l21, t11, input_precision="ieee"), input_precision="ieee")
    t32 = -tl.dot(t33, tl.dot(l32, t22, input_precision="ieee"), input_precision="ieee")
    t20 = -tl.dot(t22, tl.dot(l20, t00, input_precision="ieee") + tl.dot(l21, t10, input_precision="ieee"),
                  input_precision="ieee")
    t31 = -tl.dot(t33, tl.dot(l31, t11, input_precision="ieee") + tl.dot(l32, t21, input_precision="ieee"),
                  input_precision="ieee")
    t30 = -tl.dot(t33, tl.dot(l30, t00, input_precision="ieee") + tl.dot(l31, t10, input_precision="ieee")
                  + tl.dot(l32, t20, input_precision="ieee"), input_precision="ieee")

    i_ch = i_c.to(tl.int64) * HV + i_hv
    p = A + i_ch * 4096
    zero = tl.zeros([16, 16], dtype=tl.float32)
    _store16(p, t00, 0, 0)
    _store16(p, zero, 0, 16)
    _store16(p, zero, 0, 32)
    _store16(p, zero, 0, 48)
    _store16(p, t10, 16, 0)
    _store16(p, t11, 16, 16)
    _store16(p, zero, 16, 32)
    _store16(p, zero, 16, 48)
    _store16(p, t20, 32, 0)
    _store16(p, t21, 32, 16)
    _store16(p, t22, 32, 32)
    _store16(p, zero, 32, 48)
    _store16(p, t30, 48, 0)
    _store16(p, t31, 48, 16)
    _store16(p, t32, 48, 32)
    _store16(p, t33, 48, 48)

    # P and the row scales over the whole chunk.
    p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (r0, 0), (64, BK), (1, 0))
    p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (r0, 0), (64, BK), (1, 0))
    b_q = tl.load(p_q, boundary_check=(0, 1), padding_option="zero")
    b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
    o_i = tl.arange(0, 64)
    m_t = r0 + o_i < T
    b_g = tl.load(g + (bos + r0 + o_i) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_b = tl.load(beta + (bos + r0 + o_i) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_c = tl.cumsum(b_g, 0)
    g_last = tl.sum(b_g, 0)
    if L2NORM:
        qf = b_q.to(tl.float32)
        kf = b_k.to(tl.float32)
        rq = tl.rsqrt(tl.sum(qf * qf, 1) + 1e-6)
        rk = tl.rsqrt(tl.sum(kf * kf, 1) + 1e-6)
        b_qn = (qf * rq[:, None]).to(b_q.dtype)
        b_kn = (kf * rk[:, None]).to(b_k.dtype)
    else:
        rq = tl.full([64], 1.0, dtype=tl.float32)
        rk = tl.full([64], 1.0, dtype=tl.float32)
        b_qn = b_q
        b_kn = b_k
    causal = o_i[:, None] >= o_i[None, :]
    b_qk = tl.dot(b_qn, tl.trans(b_kn))
    decay = tl.exp(tl.where(causal, b_c[:, None] - b_c[None, :], 0.0))
    b_p = tl.where(causal, b_qk * decay * scale, 0.0)
    tl.store(P + i_ch * 4096 + o_i[:, None] * 64 + o_i[None, :], b_p.to(P.dtype.element_ty))

    e_c = tl.exp(b_c)
    p_r = R + i_ch * (4 * 64) + o_i
    tl.store(p_r, tl.where(m_t, scale * e_c * rq, 0.0))
    tl.store(p_r + 64, tl.where(m_t, b_b * e_c * rk, 0.0))
    tl.store(p_r + 128, tl.where(m_t, tl.exp(g_last - b_c) * rk, 0.0))
    tl.store(p_r + 192, b_b)
    tl.store(G + i_ch, tl.exp(g_last))


@triton.jit
def _chunk_state_kernel(q, k, v, A, P, R, G, o, h0, ht, cu_seqlens, chunk_offsets, stride_sk, stride_sv,
                        H, HV, WORK_LOG2, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    start = tl.load(cu_seqlens + i_n)
    T = tl.load(cu_seqlens + i_n + 1) - start
    bos = start.to(tl.int64)
    c_first = tl.load(chunk_offsets + i_n).to(tl.int64)
    dt = k.dtype.element_ty

    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        p_h0 = tl.make_block_ptr(h0 + i_nh.to(tl.int64) * K * V, (K, V), (stride_sk, stride_sv), (0, i_v * BV),
                                 (BK, BV), (1, 0))
        b_s = tl.load(p_h0, boundary_check=(0, 1), padding_option="zero").to(tl.float32)

    o_i = tl.arange(0, 64)
    for i_t in range(tl.cdiv(T, 64)):
        i_ch = (c_first + i_t) * HV + i_hv
        p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
        p_v = tl.make_block_ptr(v + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * 64, i_v * BV),
                                (64, BV), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1), padding_option="zero")
        b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
        b_v = tl.load(p_v, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        b_a = tl.load(A + i_ch * 4096 + o_i[:, None] * 64 + o_i[None, :]).to(dt)
        b_p = tl.load(P + i_ch * 4096 + o_i[:, None] * 64 + o_i[None, :]).to(dt)
        p_r = R + i_ch * (4 * 64) + o_i
        r_q = tl.load(p_r)
        r_k = tl.load(p_r + 64)
        r_d = tl.load(p_r + 128)
        r_b = tl.load(p_r + 192)
        e_last = tl.load(G + i_ch)

        b_sd = b_s.to(dt)
        b_ks = tl.dot(b_k, b_sd)
        b_qs = tl.dot(b_q, b_sd)
        b_y = (b_v * r_b[:, None] - b_ks * r_k[:, None]).to(dt)
        b_vn = tl.dot(b_a, b_y)
        b_o = b_qs * r_q[:, None] + tl.dot(b_p, b_vn.to(dt))
        p_o = tl.make_block_ptr(o + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * 64, i_v * BV),
                                (64, BV), (1, 0))
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), boundary_check=(0, 1))
        b_s = b_s * e_last + tl.dot(tl.trans(b_k), (b_vn * r_d[:, None]).to(dt))

    if STORE_FINAL:
        p_ht = tl.make_block_ptr(ht + i_nh.to(tl.int64) * K * V, (K, V), (stride_sk, stride_sv), (0, i_v * BV),
                                 (BK, BV), (1, 0))
        tl.store(p_ht, b_s.to(p_ht.dtype.element_ty), boundary_check=(0, 1))


# (BV, num_warps, num_stages) of the state kernel. The kernel only writes o and the final state, so
# Triton's autotuner may rerun it freely. Narrow V blocks give a short single sequence more programs.
STATE_CONFIGS = ((64, 4, 2), (64, 8, 2), (64, 4, 1), (32, 4, 2), (128, 8, 2))


def _autotuned(kernel, configs, key):
    """``kernel`` autotuned over (BV, num_warps, num_stages) triples."""
    return triton.autotune(
        configs=[triton.Config({"BV": bv}, num_warps=w, num_stages=st) for bv, w, st in configs], key=key,
    )(kernel)


_chunk_state_tuned = _autotuned(_chunk_state_kernel, STATE_CONFIGS, ["H", "HV", "WORK_LOG2", "K", "V"])


def _sequences(cu_seqlens: torch.Tensor | None, B: int, T: int, device: torch.device
               ) -> tuple[torch.Tensor, list[int]]:
    """Offsets as a device int32 tensor and as host ints (the chunk table needs them on the host)."""
    if cu_seqlens is None:
        offs = [i * T for i in range(B + 1)]
        return torch.tensor(offs, dtype=torch.int32, device=device), offs
    offs = cu_seqlens.tolist()
    return cu_seqlens.to(device=device, dtype=torch.int32), offs


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                               use_qk_l2norm_in_kernel, state_v_first, config: tuple[int, int, int] | None = None,
                               variant: Variant | None = None):
    """``variant``: how the sequential part is cut (default FUSED, the fastest measured on the H200);
    `hybridkv bench gdn --variants` times all three side by side with FLA."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K > 256 or V > 256:
        raise ValueError(f"head dims up to 256 are supported, got K={K}, V={V}")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    cu, offs = _sequences(cu_seqlens, B, T, q.device)
    N = len(offs) - 1
    counts = [triton.cdiv(offs[n + 1] - offs[n], BT) for n in range(N)]
    table = [(n, c) for n in range(N) for c in range(counts[n])]
    o = torch.empty_like(v)
    final = None
    if output_final_state:
        final = q.new_empty((N, HV, V, K) if state_v_first else (N, HV, K, V), dtype=torch.float32)
    if not table:
        if final is not None:
            final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
        return o, final
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    host = torch.tensor([x for pair in table for x in pair] + starts, dtype=torch.int32)
    dev = host.to(q.device, non_blocking=True)
    chunk_table, chunk_offsets = dev[: 2 * len(table)], dev[2 * len(table):]
    NC = len(table)
    sdt = torch.bfloat16 if q.dtype != torch.float32 else torch.float32
    A = q.new_empty((NC, HV, BT, BT), dtype=sdt)
    Pm = q.new_empty((NC, HV, BT, BT), dtype=sdt)
    R = q.new_empty((NC, HV, _NROW, BT), dtype=torch.float32)
    G = q.new_empty((NC, HV), dtype=torch.float32)
    BK = triton.next_power_of_2(K)
    _chunk_prep_kernel[(NC, HV)](q, k, g, beta, A, Pm, R, G, cu, chunk_table, scale, H, HV, K=K, BK=BK,
                                 L2NORM=use_qk_l2norm_in_kernel, num_warps=4)
    h0 = initial_state.contiguous() if initial_state is not None else None
    # The state kernel indexes K rows and V columns; a V-first state is the transposed view.
    stride_sk, stride_sv = (1, K) if state_v_first else (V, 1)
    work_log2 = max(N * HV, 1).bit_length()
    flags = dict(K=K, V=V, BK=BK, HAS_H0=h0 is not None, STORE_FINAL=final is not None)
    variant = variant or Variant.FUSED
    if variant is Variant.FUSED:
        common = (q, k, v, A, Pm, R, G, o, h0, final, cu, chunk_offsets, stride_sk, stride_sv, H, HV, work_log2)
        _launch(_chunk_state_kernel, _chunk_state_tuned, common, flags, config, V, N * HV)
        return o, final
    from hybridkv.kernels.gdn import triton_chunk_split

    triton_chunk_split.run(variant, q, k, v, A, Pm, R, G, o, h0, final, cu, chunk_table, chunk_offsets,
                           stride_sk, stride_sv, H, HV, work_log2, flags, config)
    return o, final


def _launch(kernel, tuned, args, flags, config, V: int, programs: int) -> None:
    """The sequential kernel, autotuned, or with a fixed (BV, num_warps, num_stages)."""
    if config is None:
        tuned[lambda meta: (triton.cdiv(V, meta["BV"]), programs)](*args, **flags)
    else:
        bv, warps, stages = config
        kernel[(triton.cdiv(V, bv), programs)](*args, **flags, BV=bv, num_warps=warps, num_stages=stages)
