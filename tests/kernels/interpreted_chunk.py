"""Run by test_gdn_interpreted.py in a subprocess: the Triton chunk kernels in Triton's CPU interpreter
(TRITON_INTERPRET=1, set before Triton is imported) against the pure-torch reference, for every
schedule. Prints one JSON object: {schedule/l2norm: [o error, state error]}.

Triton 3.6's interpreter has two numpy-2 faults that these kernels hit, patched by interpreter_patches.py.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import interpreter_patches  # noqa: E402, F401  (beside this script: the interpreter's numpy-2 faults)

from hybridkv.kernels.gdn import naive as reference  # noqa: E402
from hybridkv.kernels.gdn import chunk as triton_chunk


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def sequences(lens: list[int], out: dict, l2s: tuple[bool, ...] = (True, False)) -> None:
    """Every schedule and form on one varlen batch. Three sequences (7 chunks, exactly one, a partial one) in
    three segments: the short ones hand their state through the later segments; one sequence alone (5
    chunks): its segments are row ranges. Sized for CI's time (the interpreter runs every program in turn):
    each segment still holds several chunks, so state is carried inside a segment and handed across segments."""
    H, HV, K = 1, 2, 128
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q = torch.randn(1, T, H, K).bfloat16()
    k = torch.randn(1, T, H, K).bfloat16()
    v = torch.randn(1, T, HV, K).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV) + 3)
    beta = torch.rand(1, T, HV)
    h0 = torch.randn(len(lens), HV, K, K) * 0.1
    for l2 in l2s:
        # l2norm on: queries and keys of unequal norms (0.25-4x), so a row's norm used for another's
        # shows; off: unnormalised keys kept small for a stable recurrence.
        spread = lambda x: (x.float() * 4 ** (2 * torch.rand(1, T, H, 1) - 1)).bfloat16()  # noqa: E731
        qq = spread(q) if l2 else q
        kk = spread(k) if l2 else (k.float() / 12).bfloat16()
        o_ref, s_ref = reference.chunk_reference(qq, kk, v, g, beta, K**-0.5, h0, True, cu, l2)
        for schedule in (triton_chunk.Schedule.SERIAL, triton_chunk.Schedule.PIPELINED):
            o, s = triton_chunk.chunk_gated_delta_rule_fwd(qq, kk, v, g, beta, K**-0.5, h0, True, cu, l2, False,
                                                           config=(64, 4, 2), schedule=schedule, segments=3)
            out[f"{len(lens)}seq/{schedule.value}/l2={l2}"] = [rel(o, o_ref), rel(s, s_ref)]
        # The scores form: P made in parallel, loaded by the chain.
        o, s = triton_chunk.chunk_gated_delta_rule_fwd(qq, kk, v, g, beta, K**-0.5, h0, True, cu, l2, False,
                                                       config=(64, 4, 2), schedule=triton_chunk.Schedule.PIPELINED,
                                                       segments=3, form=triton_chunk.Form.SCORES)
        out[f"{len(lens)}seq/scores-pipelined/l2={l2}"] = [rel(o, o_ref), rel(s, s_ref)]
        # Segments at once from scanned start states (in the scores form: the fused form's chain is the
        # same kernel and runs above; the scan is checked with the fused form at fp16 below). Once per
        # sequence cut: l2norm lives in the inverse kernel, which the schedules above cover both ways.
        # Slow decay here: with the gates above a segment's start state is ~gone two chunks later, so a
        # scan that dropped M S (each segment started from the last one's B alone) matched to 1e-4.
        if l2:
            g_slow = torch.nn.functional.logsigmoid(torch.randn(1, T, HV) + 7)
            o_ref_s, s_ref_s = reference.chunk_reference(qq, kk, v, g_slow, beta, K**-0.5, h0, True, cu, l2)
            o, s = triton_chunk.chunk_gated_delta_rule_fwd(qq, kk, v, g_slow, beta, K**-0.5, h0, True, cu, l2,
                                                           False, config=(64, 4, 2),
                                                           schedule=triton_chunk.Schedule.SCAN, segments=3,
                                                           form=triton_chunk.Form.SCORES)
            out[f"{len(lens)}seq/scores-scan/l2={l2}"] = [rel(o, o_ref_s), rel(s, s_ref_s)]


def half_precision(out: dict) -> None:
    """fp16 at K != V, every form, and the scan from a V-first initial state."""
    # fp16, K != V (64 and 96), one sequence with a partial last chunk, serial: the split form's
    # unsegmented chain, and its operands kept in k's dtype (fp16 operands meet fp16 k).
    T, H, HV = 150, 1, 2
    q, k = (torch.randn(1, T, H, 64).half() for _ in range(2))
    v = torch.randn(1, T, HV, 96).half()
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV) + 3)
    beta = torch.rand(1, T, HV)
    cu = torch.tensor([0, T])
    o_ref, s_ref = reference.chunk_reference(q, k, v, g, beta, 64**-0.5, None, True, cu, True)
    for form in triton_chunk.Form:
        o, s = triton_chunk.chunk_gated_delta_rule_fwd(q, k, v, g, beta, 64**-0.5, None, True, cu, True, False,
                                                       config=(32, 4, 2), schedule=triton_chunk.Schedule.SERIAL,
                                                       form=form)
        out[f"fp16-k64-v96/{form.value}"] = [rel(o, o_ref), rel(s, s_ref)]
    # The scan at K != V with a V block that does not divide V, from an initial state held V-first (the
    # scan kernel reads it through the transposed strides): three segments of one chunk or less. Slow decay
    # and small beta, so a state carried wrongly between segments shows: with the gates above a chunk
    # forgets ~99% of its start state, and a scan that dropped every carry stayed within 2e-3.
    g_slow = torch.nn.functional.logsigmoid(torch.randn(1, T, HV) + 7)
    beta_small = 0.1 * torch.rand(1, T, HV)
    h0 = torch.randn(1, HV, 64, 96)
    o_ref, s_ref = reference.chunk_reference(q, k, v, g_slow, beta_small, 64**-0.5, h0, True, cu, True)
    o, s = triton_chunk.chunk_gated_delta_rule_fwd(q, k, v, g_slow, beta_small, 64**-0.5,
                                                   h0.transpose(-1, -2).contiguous(), True, cu, True, True,
                                                   config=(64, 4, 2), schedule=triton_chunk.Schedule.SCAN, segments=3)
    out["fp16-k64-v96/scan"] = [rel(o, o_ref), rel(s.transpose(-1, -2), s_ref)]


# Two halves of about equal interpreter time (l2norm on or off, and the rest split between them), which
# test_gdn_interpreted runs side by side: the interpreter is single-threaded and CI has two cores.
def decode_tma(out: dict) -> None:
    """The TMA decode walk (`triton_decode_tma`) on layer 1 of a two-layer slot pool (a strided view), with pads
    and a walk that wraps (more tiles than programs): [o error, state error] against the reference, then
    "decode-tma/vs-tile": the largest difference from the tile kernel on the same inputs (the same arithmetic, so
    zero), "decode-tma/untouched": 1.0 when layer 0, the pads' and the unused slots are bit for bit as before, and
    "decode-tma/qkv-tma": 1.0 when reading q, k, v through tensor descriptors changes no bit, and
    "decode-rows/vs-tile": 1.0 when the row-looped kernel equals the tile kernel bit for bit at three configs.
    "decode-prefetch/vs-tile": the same for its register-prefetching form at every shipped config and two more."""
    from hybridkv.kernels.gdn import decode_tma as triton_decode_tma
    from hybridkv.kernels.gdn import fused_recurrent as triton_recurrent
    from hybridkv.kernels.gdn import decode_kernels

    N, H, HV, K, V, slots = 5, 2, 4, 32, 64, 9
    q, k = torch.randn(N, H, K).bfloat16(), torch.randn(N, H, K).bfloat16()
    v = torch.randn(N, HV, V).bfloat16()
    a, b = torch.randn(N, HV), torch.randn(N, HV)
    A_log, dt_bias = torch.randn(HV) * 0.5, torch.randn(HV) * 0.5
    pool = (torch.randn(slots, 2, HV, V, K) * 0.1).bfloat16()
    idx = torch.tensor([3, -1, 0, 8, 5])
    before = pool.clone()
    want = before[:, 1].clone()
    o_ref = reference.decode_reference(q, k, v, a, b, A_log, dt_bias, want, idx, K**-0.5, True, True)
    o = torch.full_like(v, float("nan"))
    # BV 32 of V 64, three "SMs" at two programs each: 40 tiles over 6 programs.
    triton_decode_tma.launch((32, 4, 2, 2), q, k, v, a, b, A_log, dt_bias, o, pool[:, 1], idx, K**-0.5, True, 1.0,
                             20.0, sms=3)
    out["decode-tma"] = [rel(o, o_ref), rel(pool[:, 1][idx[idx >= 0]], want[idx[idx >= 0]])]
    tile_pool = before.clone()
    o_tile = torch.empty_like(v)
    decode_kernels._launch_tile((32, 4), q, k, v, a, b, A_log, dt_bias, o_tile, tile_pool[:, 1], idx, K**-0.5,
                                    True, True, 1.0, 20.0)
    out["decode-tma/vs-tile"] = max((o.float() - o_tile.float()).abs().max().item(),
                                    (pool.float() - tile_pool.float()).abs().max().item())
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[idx[idx >= 0]] = False
    same = torch.equal(pool[:, 0], before[:, 0]) and torch.equal(pool[untouched], before[untouched])
    out["decode-tma/untouched"] = float(same and torch.equal(o[1], torch.zeros_like(o[1])))
    # q, k and v through tensor descriptors (`QKV.TMA`, a tuner candidate): the same values, so the same bits as the
    # walk's plain loads at the same config. K = 64 and BV 64 here: every row TMA stages must be 128 bytes.
    q64, k64 = torch.randn(N, H, 64).bfloat16(), torch.randn(N, H, 64).bfloat16()
    pool64 = (torch.randn(slots, 2, HV, V, 64) * 0.1).bfloat16()
    plain_pool, o_plain = pool64.clone(), torch.full_like(v, float("nan"))
    triton_decode_tma.launch((64, 4, 2, 2), q64, k64, v, a, b, A_log, dt_bias, o_plain, plain_pool[:, 1], idx, 0.125,
                             True, 1.0, 20.0, sms=3)
    qkv_pool, o_qkv = pool64.clone(), torch.full_like(v, float("nan"))
    triton_decode_tma.launch((64, 4, 2, 2), q64, k64, v, a, b, A_log, dt_bias, o_qkv, qkv_pool[:, 1], idx, 0.125,
                             True, 1.0, 20.0, sms=3, qkv=triton_decode_tma.QKV.TMA)
    out["decode-tma/qkv-tma"] = float(torch.equal(qkv_pool, plain_pool) and torch.equal(o_qkv, o_plain)
                                      and not torch.equal(plain_pool, pool64))
    # The row-looped kernel (`triton_decode_rows`): the tile kernel's arithmetic block by block; in the interpreter the
    # row sums do not depend on the layout, so the same bits, pads and the other layer untouched.
    from hybridkv.kernels.gdn import decode_rows as triton_decode_rows

    same_rows = True
    for cfg in ((8, 64, 4, 3), (4, 32, 4, 3), (16, 128, 4, 2)):  # ROWS capped at V = 64: one program a head too
        rows_pool, o_rows = before.clone(), torch.full_like(v, float("nan"))
        triton_decode_rows.launch(cfg, q, k, v, a, b, A_log, dt_bias, o_rows, rows_pool[:, 1], idx, K**-0.5, True,
                                  1.0, 20.0)
        same_rows &= torch.equal(rows_pool, tile_pool) and torch.equal(o_rows, o_tile)
    out["decode-rows/vs-tile"] = float(same_rows)
    # Its register-prefetching form (`triton_decode_prefetch`): the same blocks, the same arithmetic, so the same bits.
    # (8, 8, 1): one block a program, an odd count for the loop unrolled by two and nothing to prefetch past it.
    from hybridkv.kernels.gdn import decode_prefetch as triton_decode_prefetch

    same_prefetch = True
    for cfg in (*triton_decode_prefetch.PREFETCH_CONFIGS, (8, 8, 1), (16, 32, 2)):
        pre_pool, o_pre = before.clone(), torch.full_like(v, float("nan"))
        triton_decode_prefetch.launch(cfg, q, k, v, a, b, A_log, dt_bias, o_pre, pre_pool[:, 1], idx, K**-0.5, True,
                                      1.0, 20.0)
        same_prefetch &= torch.equal(pre_pool, tile_pool) and torch.equal(o_pre, o_tile)
    out["decode-prefetch/vs-tile"] = float(same_prefetch)


PARTS = {
    "l2": lambda out: (sequences([400, 64, 30], out, (True,)), sequences([300], out, (True,)), half_precision(out),
                       decode_tma(out)),
    "no-l2": lambda out: (sequences([400, 64, 30], out, (False,)), sequences([300], out, (False,)),
                          ),
}


def main(part: str) -> int:
    if part not in PARTS:
        raise ValueError(f"part must be one of {sorted(PARTS)}, got {part!r}")
    torch.manual_seed(0)
    out: dict = {}
    PARTS[part](out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
