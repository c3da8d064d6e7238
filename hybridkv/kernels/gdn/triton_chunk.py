"""Triton chunked gated delta rule (forward), two kernels; `reference.chunk_reference` is its oracle.

1. `_chunk_inverse_kernel` (`triton_chunk_inverse`), parallel over (chunk, value head): what does not
   depend on the state. T = (I + L)^-1 of the decayed, beta-scaled K K^T, and per-token row scales that
   fold the l2 norms, beta and the decays into the state kernel's GEMM epilogues.
2. `_chunk_state_kernel`, sequential over the chunks of one (sequence, value head, V block) with the
   state in registers. Per chunk: K S and Q S, V' = T (beta V - sk K S), the masked, decayed Q K^T,
   O = sq Q S + P V', S = e^g_last S + K^T (sd V'). Raw q and k go straight into the GEMMs (shared
   by the value heads of a key head, so mostly L2 hits); no w, u, h, v_new or P in HBM.

Measured on one H200 (`hybridkv bench gdn --breakdown`, Triton 3.6): the first version's single prep
kernel (inverse and P together, four warps) took 1.6 ms of 2.2 at 35B 4x8192; its row-by-row
inverse reduced across warps 60 times per chunk. Taking GEMMs off the chain instead (a chain/output
split, FLA's W/U cut) was slower on every shape; that code is in git history (commit d3329ca).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.kernels.gdn.triton_chunk_inverse import (
    _NROW,
    _R_STRIDE,
    BT,
    INVERSE_METHOD,
    INVERSE_PRECISION,
    INVERSE_WARPS,
    _chunk_inverse_kernel,
)


@triton.jit
def _chunk_state_kernel(q, k, v, A, R, G, o, h0, ht, cu_seqlens, chunk_offsets, stride_sk, stride_sv,
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
    causal = o_i[:, None] >= o_i[None, :]
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
        p_r = R + i_ch * _R_STRIDE + o_i
        r_q = tl.load(p_r)
        r_k = tl.load(p_r + 64)
        r_d = tl.load(p_r + 128)
        r_b = tl.load(p_r + 192)
        r_c = tl.load(p_r + 256)
        r_qn = tl.load(p_r + 320)
        r_kn = tl.load(p_r + 384)
        e_last = tl.load(G + i_ch)

        # P = scale (q_i . k_j) rq_i rk_j e^(gamma_i - gamma_j), j <= i: raw q and k, norms in the epilogue.
        b_qk = tl.dot(b_q, tl.trans(b_k))
        decay = tl.exp(tl.where(causal, r_c[:, None] - r_c[None, :], 0.0))
        b_p = tl.where(causal, b_qk * decay * (r_qn[:, None] * r_kn[None, :]), 0.0).to(dt)

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


_chunk_state_tuned = triton.autotune(
    configs=[triton.Config({"BV": bv}, num_warps=w, num_stages=st) for bv, w, st in STATE_CONFIGS],
    key=["H", "HV", "WORK_LOG2", "K", "V"],
)(_chunk_state_kernel)


def _chunk_tables(cu_seqlens: torch.Tensor | None, B: int, T: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(cu_seqlens, chunk table, chunk offsets, table rows), made on the device with no host sync.

    Reading the offsets on the host would wait for every kernel queued before this call (a stall of the
    whole stream per layer); instead the table gets an upper bound of rows, sum ceil(len / 64) <=
    (T + 63 N) // 64, and rows past the last chunk hold sequence -1 (their programs return at once).
    """
    if cu_seqlens is None:
        cu = torch.arange(B + 1, dtype=torch.int32, device=device) * T
        rows = B * triton.cdiv(T, BT)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
        rows = (T + (BT - 1) * (cu.numel() - 1)) // BT
    N = cu.numel() - 1
    counts = (cu[1:] - cu[:-1] + (BT - 1)) // BT
    offsets = torch.zeros(N + 1, dtype=torch.int32, device=device)
    torch.cumsum(counts, 0, out=offsets[1:])
    idx = torch.arange(rows, dtype=torch.int32, device=device)
    seq = torch.searchsorted(offsets[1:], idx, right=True).to(torch.int32)
    chunk = idx - offsets[seq.clamp(max=max(N - 1, 0))]
    table = torch.stack((torch.where(seq < N, seq, -1), chunk), 1).contiguous()
    return cu, table, offsets, rows


class _TableCache:
    """The last call's chunk tables: every GDN layer of a forward pass passes the same cu_seqlens, and
    rebuilding the tables costs ~10 small launches per layer. Keyed by the tensor object and its
    version counter (an in-place edit of cu_seqlens bumps it), as FLA's tensor_cache does by identity."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._ref: torch.Tensor | None = None
        self._value: tuple | None = None

    def get(self, cu_seqlens: torch.Tensor | None, B: int, T: int, device: torch.device):
        key = (B, T, device, None if cu_seqlens is None else cu_seqlens._version)
        if self._value is not None and key == self._key and self._ref is cu_seqlens:
            return self._value
        value = _chunk_tables(cu_seqlens, B, T, device)
        self._key, self._ref, self._value = key, cu_seqlens, value
        return value


_tables = _TableCache()


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                               use_qk_l2norm_in_kernel, state_v_first, config: tuple[int, int, int] | None = None):
    """``config``: a fixed (BV, num_warps, num_stages) for the state kernel instead of the autotuner."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K > 256 or V > 256:
        raise ValueError(f"head dims up to 256 are supported, got K={K}, V={V}")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    cu, chunk_table, chunk_offsets, NC = _tables.get(cu_seqlens, B, T, q.device)
    N = cu.numel() - 1
    o = torch.empty_like(v)
    final = None
    if output_final_state:
        final = q.new_empty((N, HV, V, K) if state_v_first else (N, HV, K, V), dtype=torch.float32)
    if NC == 0:  # no tokens at all: the final state is the initial one
        if final is not None:
            final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
        return o, final
    sdt = torch.bfloat16 if q.dtype != torch.float32 else torch.float32
    A = q.new_empty((NC, HV, BT, BT), dtype=sdt)
    R = q.new_empty((NC, HV, _NROW, BT), dtype=torch.float32)
    G = q.new_empty((NC, HV), dtype=torch.float32)
    BK = triton.next_power_of_2(K)
    _chunk_inverse_kernel[(NC, HV)](q, k, g, beta, A, R, G, cu, chunk_table, scale, H, HV, K=K, BK=BK,
                                    L2NORM=use_qk_l2norm_in_kernel, METHOD=INVERSE_METHOD,
                                    PREC=INVERSE_PRECISION, num_warps=INVERSE_WARPS)
    h0 = initial_state.contiguous() if initial_state is not None else None
    # The state kernel indexes K rows and V columns; a V-first state is the transposed view.
    stride_sk, stride_sv = (1, K) if state_v_first else (V, 1)
    args = (q, k, v, A, R, G, o, h0, final, cu, chunk_offsets, stride_sk, stride_sv, H, HV,
            max(N * HV, 1).bit_length())
    flags = dict(K=K, V=V, BK=BK, HAS_H0=h0 is not None, STORE_FINAL=final is not None)
    if config is None:
        _chunk_state_tuned[lambda meta: (triton.cdiv(V, meta["BV"]), N * HV)](*args, **flags)
    else:
        bv, warps, stages = config
        _chunk_state_kernel[(triton.cdiv(V, bv), N * HV)](*args, **flags, BV=bv, num_warps=warps,
                                                           num_stages=stages)
    return o, final
