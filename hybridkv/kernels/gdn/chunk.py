"""Chunked gated delta rule, forward, on 64-token chunks; `naive.chunk_reference` is its oracle.

q, k `[B, T, H, K]`, v `[B, T, HV, V]`, g (log decay) and beta `[B, T, HV]`, varlen `cu_seqlens` `[N + 1]`
(B = 1); returns o `[B, T, HV, V]` and the fp32 final state `[N, HV, K, V]` (`[N, HV, V, K]` V-first).
NC below is the number of chunk rows over all sequences (an upper bound with varlen, `_chunk_tables`).

The recurrence across chunks is the one part that cannot run in parallel, so a call cuts the work in two:

1. The inverse (`inverse`, or `gluon.inverse` on Hopper), parallel over (chunk, value-head group): T = (I + L)^-1
   `[NC, HV, 64, 64]` of the decayed, beta-scaled K K^T, and per-token row scales `[NC, HV, 8, 64]` that fold the
   l2 norms, beta and the decays into the state kernel's GEMM epilogues, so that kernel multiplies raw q and k.
2. `_chunk_state_kernel`, sequential over the chunks of one (sequence, value head, V block) with the `[K, BV]`
   state in fp32 registers. Per chunk: K S and Q S, V' = T (beta V - sk K S), the masked, decayed Q K^T (P),
   O = sq Q S + P V', S = e^g_last S + K^T (sd V'). w, u, h, v_new and P never go to HBM (storing FLA's W/U
   intermediates instead was slower on every benchmark shape). On Hopper `gluon.chain` runs the same chain with
   wgmma where the plan says so.

`chunk_plan.plan` picks the form (P made on the chain, or made in parallel and loaded), the schedule (serial,
pipelined over two streams, or a scan over segments of one sequence) and the state kernel's config from the call's
shape; docs/kernels.md describes them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hybridkv.kernels.gdn import pdl as _pdl
from hybridkv.kernels.gdn.chunk_plan import (
    PIPELINE_SEGMENTS,
    Form,
    Plan,
    Schedule,
    gluon_chain_fits,
    plan,
    scan_segments,
)
from hybridkv.kernels.gdn.chunk_rows import _chain_program, _initial_state, _scores
from hybridkv.kernels.gdn.inverse import (
    _NROW,
    _R_STRIDE,
    BKC,
    BT,
    MERGE_PREC,
    SCORES_WARPS,
    WARPS,
    InverseConfig,
    _chunk_inverse_kernel,
    _chunk_scores_kernel,
    default_inverse,
)


@triton.jit
def _chunk_state_kernel(q, k, v, A, P, R, G, o, h_in, h_out, cu_seqlens, chunk_offsets, c_lo, c_hi,
                        stride_ik, stride_iv, stride_ok, stride_ov, H, HV, WORK_LOG2, K: tl.constexpr,
                        V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H_IN: tl.constexpr,
                        HAS_H_OUT: tl.constexpr, SEGMENTED: tl.constexpr, SCORES_IN: tl.constexpr,
                        SCAN: tl.constexpr = False, PDL: tl.constexpr = False):
    """The state chain of one (sequence, value head, V block): grid (cdiv(V, BV), N * HV).

    Walks every chunk of the sequence, or with SEGMENTED (one segment of a pipelined call) the chunks
    c_lo <= i < c_hi; the `[K, BV]` state starts from h_in (zeros without it) and is left in h_out.
    Writes o `[B, T, HV, V]`. A (T, `[NC, HV, 64, 64]`), R (row scales, `[NC, HV, 8, 64]`) and G (e^g_last,
    `[NC, HV]`) come from `_chunk_inverse_kernel`. SCORES_IN (`Form.SCORES`): the masked scores are loaded
    from P `[NC, HV, 64, 64]` (made by `_chunk_scores_kernel` or the Gluon inverse), not made here.

    SCAN (`Schedule.SCAN`, `chunk_scan`): grid (cdiv(V, BV), N * HV, segments); program_id(2) is the
    segment, which walks chunks [i c_hi, (i + 1) c_hi) (c_hi is the chunks per segment) from its start
    state h_in `[segments, N * HV, K, V]`; only the last segment writes h_out. PDL: launched as a programmatic
    dependent launch (`pdl`)."""
    _pdl.wait(PDL)
    i_v, i_nh, i_hv, i_h, T, bos, c_first = _chain_program(cu_seqlens, chunk_offsets, H, HV)
    dt = k.dtype.element_ty
    i_state = i_nh
    last = True
    if SCAN:
        i_seg = tl.program_id(2)
        c_lo = i_seg * c_hi
        c_hi = c_lo + c_hi
        i_state = i_seg * tl.num_programs(1) + i_nh
        last = i_seg == tl.num_programs(2) - 1
    b_s = _initial_state(h_in, i_state, i_v, stride_ik, stride_iv, K, V, BK, BV, HAS_H_IN)

    o_i = tl.arange(0, 64)
    # Unsegmented, the loop starts at the constant 0: with a runtime start Triton's pipeliner emits extra
    # instructions in every chunk (sm_90 SASS). A segment past this sequence's end runs no chunk and only
    # hands its state on (h_in to h_out).
    n_t = tl.cdiv(T, 64)
    for i_t in range(c_lo if SEGMENTED or SCAN else 0, tl.minimum(n_t, c_hi) if SEGMENTED or SCAN else n_t):
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
        e_last = tl.load(G + i_ch)
        if SCORES_IN:
            b_p = tl.load(P + i_ch * 4096 + o_i[:, None] * 64 + o_i[None, :])
        else:
            b_p = _scores(b_q, b_k, tl.load(p_r + 256), tl.load(p_r + 320), tl.load(p_r + 384), dt)

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

    if HAS_H_OUT:
        if last:
            p_ht = tl.make_block_ptr(h_out + i_nh.to(tl.int64) * K * V, (K, V), (stride_ok, stride_ov),
                                     (0, i_v * BV), (BK, BV), (1, 0))
            tl.store(p_ht, b_s.to(p_ht.dtype.element_ty), boundary_check=(0, 1))


# (BV, num_warps, num_stages) of the state kernel. The kernel only writes o and the final state, so
# Triton's autotuner may rerun it freely. Narrow V blocks give a short single sequence more programs.
STATE_CONFIGS = ((64, 4, 2), (64, 8, 2), (64, 4, 1), (32, 4, 2), (128, 8, 2))


_chunk_state_tuned = triton.autotune(
    configs=[triton.Config({"BV": bv}, num_warps=w, num_stages=st) for bv, w, st in STATE_CONFIGS],
    key=["H", "HV", "WORK_LOG2", "K", "V", "SCORES_IN"],
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


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    # Asked on every call (`default_inverse`); the device's answer does not change.
    return torch.cuda.get_device_capability(index)


@functools.cache
def gluon_ready() -> bool:
    """Whether this Triton's Gluon has what hybridkv's Gluon kernels use (written against Triton 3.6: Hopper's wgmma
    and TMA, Ampere's mma_v2, padded shared layouts); without it the Triton kernels run where Gluon ones would."""
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import ampere, hopper
    except ImportError:
        return False
    return (hasattr(gl, "PaddedSharedLayout") and hasattr(ampere, "mma_v2") and hasattr(hopper, "warpgroup_mma")
            and hasattr(hopper, "tma"))


def _gluon_chain_refusal(q, k, v, t_rows: int) -> str | None:
    from hybridkv.kernels.gdn.gluon import chain  # Gluon is imported where a call may run it, not before

    return chain.refusal(q, k, v, t_rows)


def _call_plan(q, k, v, N: int, HV: int, K: int, V: int, NC: int, form: Form | None) -> Plan:
    """The plan of a call on a GPU whose caller fixed neither schedule nor config: `chunk_plan.plan`, with the Gluon
    chain allowed where the shape rule (`gluon_chain_fits`, pure, so it is tested on CPU) and then the tensors
    (`gluon.chain.addressing_refusal`) say so; a refusal here is no error, the Triton chain runs."""
    gluon = gluon_chain_fits(capability=_capability(q.device.index), dtype=str(q.dtype), K=K, V=V,
                             gluon_ready=gluon_ready())
    if gluon:
        from hybridkv.kernels.gdn.gluon import chain

        gluon = chain.addressing_refusal(q, k, v, NC * HV * BT) is None
    return plan(N, HV, K, V, _sm_count(q.device.index), NC, q.element_size(), form, gluon=gluon,
                heads_per_key=HV // q.shape[2])


@functools.cache
def _side_stream(index: int) -> torch.cuda.Stream:
    # The state chain's stream: higher priority than a default stream, so its few programs are placed
    # as soon as inverse programs retire rather than behind the whole inverse grid.
    return torch.cuda.Stream(device=index, priority=-1)


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                               use_qk_l2norm_in_kernel, state_v_first, config: tuple[int, int, int] | None = None,
                               schedule: Schedule | None = None, segments: int | None = None,
                               inverse: InverseConfig | None = None, form: Form | None = None,
                               gluon_chain: bool | None = None):
    """o `[B, T, HV, V]` and the fp32 final state (None unless ``output_final_state``) of
    `api.chunk_gated_delta_rule`, whose arguments come first (validated there).

    ``config``: a fixed (BV, num_warps, num_stages) for the state kernel instead of the autotuner.
    ``schedule``: SERIAL or PIPELINED (which needs a config). With neither schedule nor config, on a GPU,
    `chunk_plan.plan` picks the schedule, the config and (``form`` None) the form; otherwise None means SERIAL and
    FUSED. ``segments``: of a pipelined call (PIPELINE_SEGMENTS). ``inverse``: how the inverse kernel is
    launched (None: `default_inverse`, the Gluon kernel on Hopper). ``gluon_chain``: True runs the chain in Gluon
    (`gluon.chain`; serial calls only), False the Triton chain; None: the plan's where the call is planned, else
    the Triton chain."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K > 256 or V > 256:
        raise ValueError(f"head dims up to 256 are supported, got K={K}, V={V}")
    if form is not None and not isinstance(form, Form):
        raise ValueError(f"form must be a Form ({', '.join(f.name for f in Form)}), got {form!r}")
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
    on_gpu = q.device.type == "cuda"
    if inverse is None:
        inverse = default_inverse(q.device.type, _capability(q.device.index) if on_gpu else None, str(q.dtype), K,
                                  gluon_ready=on_gpu and gluon_ready())
    if gluon_chain is not None and not isinstance(gluon_chain, bool):
        raise ValueError(f"gluon_chain must be True, False or None, got {gluon_chain!r}")
    if inverse is not None and not isinstance(inverse, InverseConfig):
        raise ValueError(f"inverse must be an InverseConfig or None, got {inverse!r}")
    if gluon_chain and schedule is None:  # the one call it runs: serial, fused
        schedule, form = Schedule.SERIAL, Form.FUSED if form is None else form
    chain_planned = False  # a planned Gluon chain was checked by the plan: its refusal is not asked twice
    if schedule is None and config is None and on_gpu:
        chosen = _call_plan(q, k, v, N, HV, K, V, NC, form)
        form, schedule, config, gluon_chain = chosen.form, chosen.schedule, chosen.config, chosen.gluon_chain
        chain_planned = gluon_chain
    form = Form.FUSED if form is None else form
    schedule = Schedule.SERIAL if schedule is None else schedule
    if schedule is not Schedule.SERIAL and config is None:
        raise ValueError(f"schedule {schedule.value} needs a fixed state config (BV, warps, stages)")
    if schedule is Schedule.SERIAL:
        segments = 1
    elif segments is None:
        segments = PIPELINE_SEGMENTS if schedule is Schedule.PIPELINED else scan_segments(N * HV * triton.cdiv(
            V, config[0]), _sm_count(q.device.index) if on_gpu else 132, NC)
    if segments < 1:
        raise ValueError(f"segments must be >= 1, got {segments}")
    if gluon_chain:
        if schedule is not Schedule.SERIAL:
            raise ValueError(f"the Gluon chain runs serial calls, got schedule {schedule.value}")
        refused = None if chain_planned else _gluon_chain_refusal(q, k, v, NC * HV * BT)
        if refused is not None:
            raise ValueError(refused)
    sdt = torch.bfloat16 if q.dtype != torch.float32 else torch.float32
    A = q.new_empty((NC, HV, BT, BT), dtype=sdt)
    R = q.new_empty((NC, HV, _NROW, BT), dtype=torch.float32)
    G = q.new_empty((NC, HV), dtype=torch.float32)
    # In k's dtype, as the chain's other GEMM operands are (fp16 stays fp16).
    P = q.new_empty((NC, HV, BT, BT), dtype=k.dtype) if form is Form.SCORES else A
    BK = triton.next_power_of_2(K)
    h0 = initial_state.contiguous() if initial_state is not None else None
    # The state kernel indexes K rows and V columns; a V-first state is the transposed view.
    strides = (1, K) if state_v_first else (V, 1)
    # Segments by chunk index within each sequence; NC bounds every sequence's chunk count. Between
    # segments the state waits in fp32 scratch, read and written in place by the program that owns it.
    # A scan's segments are its own (`chunk_scan.scan_call`): its parallel kernels run once over every chunk.
    cuts = segments if schedule is Schedule.PIPELINED else 1
    per = triton.cdiv(NC, cuts)
    bounds = [(j * per, min((j + 1) * per, NC)) for j in range(cuts) if j * per < NC]  # the last ends at NC
    carry = q.new_empty((N, HV, K, V), dtype=torch.float32) if len(bounds) > 1 else None
    work_log2 = max(N * HV, 1).bit_length()

    group = inverse.group_for(H, HV)
    bkc = min(BKC, BK)
    # The scores and a fixed-config state kernel start as the kernel before them drains (`pdl`); the inverse, first,
    # waits in full for what the caller queued.
    pdl = on_gpu and _pdl.enabled(q.device)
    # The scores form's P made by the Gluon inverse, or by the scores kernel after the Triton one.
    scores_in_inverse = form is Form.SCORES and inverse.gluon

    def run_inverse(c_lo, c_hi, segmented):
        # One sequence: its segment is a run of table rows; several: every row, the others return.
        row0, rows = (c_lo, c_hi - c_lo) if N == 1 else (0, NC)
        if inverse.gluon:
            from hybridkv.kernels.gdn.gluon import inverse as gluon_inverse

            gluon_inverse.launch(q, k, g, beta, A, R, G, cu, chunk_table, rows, scale, use_qk_l2norm_in_kernel,
                                 group, row0, c_lo, c_hi, segmented, P if scores_in_inverse else None)
            return
        _chunk_inverse_kernel[(rows, HV // group)](q, k, g, beta, A, R, G, cu, chunk_table, row0, c_lo, c_hi, scale,
                                                   H, HV, K=K, BK=BK, BKC=bkc, GROUP=group,
                                                   L2NORM=use_qk_l2norm_in_kernel, MPREC=MERGE_PREC,
                                                   SEGMENTED=segmented, num_warps=WARPS, num_stages=1)

    def run_scores(c_lo, c_hi, segmented, pdl=False):  # the scores form's P after the Triton inverse
        row0, rows = (c_lo, c_hi - c_lo) if N == 1 else (0, NC)
        if form is Form.SCORES and not scores_in_inverse:
            _chunk_scores_kernel[(rows, HV // group)](q, k, R, P, cu, chunk_table, row0, c_lo, c_hi, H, HV, K=K,
                                                      BK=BK, GROUP=group, SEGMENTED=segmented,
                                                      num_warps=SCORES_WARPS, num_stages=1,
                                                      **_pdl.launch_kwargs(pdl))

    def run_parallel(c_lo, c_hi):
        run_inverse(c_lo, c_hi, len(bounds) > 1)
        run_scores(c_lo, c_hi, len(bounds) > 1, pdl)

    def state(j, c_lo, c_hi):
        first, last = j == 0, j == len(bounds) - 1
        h_in, s_in = (h0, strides) if first else (carry, (V, 1))
        h_out, s_out = (final, strides) if last else (carry, (V, 1))
        tail = (o, h_in, h_out, cu, chunk_offsets, c_lo, c_hi, *s_in, *s_out, H, HV)
        kw = dict(WORK_LOG2=work_log2, K=K, V=V, BK=BK, HAS_H_IN=h_in is not None, HAS_H_OUT=h_out is not None,
                  SEGMENTED=len(bounds) > 1)
        if gluon_chain:
            from hybridkv.kernels.gdn.gluon import chain

            chain.launch(q, k, v, A, R, G, o, h_in, h_out, cu, chunk_offsets, s_in, s_out, N,
                         P=P if form is Form.SCORES else None)
            return
        args = (q, k, v, A, P, R, G, *tail)
        kw["SCORES_IN"] = form is Form.SCORES
        if config is None:
            _chunk_state_tuned[lambda meta: (triton.cdiv(V, meta["BV"]), N * HV)](*args, **kw)
        else:
            bv, warps, stages = config
            _chunk_state_kernel[(triton.cdiv(V, bv), N * HV)](*args, **kw, **_pdl.launch_kwargs(pdl), BV=bv,
                                                              num_warps=warps, num_stages=stages)

    if schedule is Schedule.SCAN:
        from hybridkv.kernels.gdn import chunk_scan

        chunk_scan.scan_call(run_inverse, run_scores, k, v, A, P, R, G, q, o, h0, final, strides, cu, chunk_offsets,
                             NC, N, H, HV, K, V, BK, segments, config, form is Form.SCORES, work_log2, pdl=pdl,
                             state_kernel=_chunk_state_kernel)
        return o, final
    if len(bounds) == 1 or not on_gpu:
        for lo, hi in bounds:
            run_parallel(lo, hi)
        for j, (lo, hi) in enumerate(bounds):
            state(j, lo, hi)
        return o, final
    # Fork and join: segment j's chain waits for segment j's inverse only; the caller's stream waits for
    # the last chain, so every tensor made here (scratch, o, final) is reused only after the side
    # stream is done with it.
    cur = torch.cuda.current_stream(q.device)
    side = _side_stream(q.device.index)
    ready = []
    for lo, hi in bounds:
        run_parallel(lo, hi)
        ready.append(torch.cuda.Event())
        ready[-1].record(cur)
    with torch.cuda.stream(side):
        for j, (lo, hi) in enumerate(bounds):
            side.wait_event(ready[j])
            state(j, lo, hi)
    cur.wait_stream(side)
    return o, final
