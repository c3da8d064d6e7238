"""`hybridkv bench plan`: per-request descriptor planning time, against a Python loop.

Workload: one 8192-token qwen3.5-397b-a17b request, hybridkv's planned layout on
both sides, no two blocks adjacent (fragmentation 1.0). Ours: `TransferPlanner.compile`
(the per-peer piece tables are built once, outside the timing, as a connector does
at handshake). Baseline, same run, same output: the straightforward way an engine
computes descriptors (vLLM's `_get_block_descs_ids` style): a Python loop over the
request's blocks and, inside, over every layer's fields, merging runs as it goes.
"""

from __future__ import annotations

import argparse
import statistics
import time

# Bounds. Tokens: 64x the longest context of any preset (262,144). Runs: a timed run of ours is
# ~100 us and one of the Python loop ~100 ms, so the bounds are minutes each.
MAX_TOKENS = 1 << 24
MAX_RUNS = 1_000_000
MAX_BASELINE_RUNS = 10_000


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = "Time per-request descriptor planning against a per-block Python loop."
    from hybridkv.cli import bounded

    parser.add_argument("--model", default="qwen3.5-397b-a17b", help="geometry preset")
    parser.add_argument("--tokens", type=bounded(int, MAX_TOKENS), default=8192, help="prompt tokens of the request")
    parser.add_argument("--runs", type=bounded(int, MAX_RUNS), default=2000,
                        help="timed runs of ours (>= 1000 for the goal)")
    parser.add_argument("--baseline-runs", type=bounded(int, MAX_BASELINE_RUNS), default=50,
                        help="timed runs of the Python loop")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def python_loop_plan(planner, src_blocks, dst_blocks):
    """The baseline: per block, per layer field, in Python, with run merging."""
    out_s, out_d = [], []
    for gid, raw in planner._raw.items():  # noqa: SLF001 - the same static tables, unmerged
        sb, db = [int(b) for b in src_blocks[gid]], [int(b) for b in dst_blocks[gid]]
        pieces = list(zip(raw.s_k.tolist(), raw.d_k.tolist(), raw.s_base.tolist(), raw.s_stride.tolist(),
                          raw.s_off.tolist(), raw.d_base.tolist(), raw.d_stride.tolist(), raw.d_off.tolist(),
                          raw.length.tolist(), raw.s_dev.tolist(), raw.d_dev.tolist(), raw.s_region.tolist(),
                          raw.d_region.tolist()))
        pairs = len(sb) if raw.is_state else -(-min(len(sb) * raw.src_block_tokens,
                                                    len(db) * raw.dst_block_tokens) // raw.pair_tokens)
        for pair in range(pairs):
            for s_k, d_k, sbase, sstr, soff, dbase, dstr, doff, ln, sdev, ddev, sreg, dreg in pieces:
                i_s = pair * raw.src_blocks_per_pair + s_k
                i_d = pair * raw.dst_blocks_per_pair + d_k
                if i_s >= len(sb) or i_d >= len(db):
                    continue
                sa = sbase + sb[i_s] * sstr + soff
                da = dbase + db[i_d] * dstr + doff
                if out_s and out_s[-1][3] == sreg and out_d[-1][3] == dreg \
                        and out_s[-1][0] + out_s[-1][1] == sa and out_d[-1][0] + out_d[-1][1] == da:
                    out_s[-1][1] += ln
                    out_d[-1][1] += ln
                else:
                    out_s.append([sa, ln, sdev, sreg])
                    out_d.append([da, ln, ddev, dreg])
    return out_s, out_d


def _median_us(fn, runs: int) -> float:
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(samples)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from hybridkv.cli import print_json
    from hybridkv.layout.alloc import VirtualAllocator
    from hybridkv.layout import plan_layout
    from hybridkv.layout.presets import get_preset

    from hybridkv.descriptors.compiler import TransferPlanner
    from hybridkv.descriptors.schemes import Workload, fragmented_blocks

    if args.runs < 1 or args.baseline_runs < 1:
        raise ValueError(f"--runs and --baseline-runs must be >= 1, got {args.runs}, {args.baseline_runs}")
    geometry = get_preset(args.model)
    w = Workload(geometry=geometry, tokens=args.tokens)
    bs = w.effective_block_size
    n = -(-args.tokens // bs)
    pages = 2 * n + 2
    alloc = VirtualAllocator()
    src = plan_layout(geometry, block_size=bs, num_blocks=pages, allocator=alloc)
    dst = plan_layout(geometry, block_size=bs, num_blocks=pages, allocator=alloc)
    t0 = time.perf_counter()
    planner = TransferPlanner(src, dst)
    setup_ms = (time.perf_counter() - t0) * 1e3
    sb, db = {}, {}
    for g in src.groups:
        count = 1 if g.block_tokens is None else n  # a state group: one page per request
        sb[g.group_id] = fragmented_blocks(count, 1.0)
        db[g.group_id] = fragmented_blocks(count, 1.0, start=1)
    plan = planner.compile(sb, db)
    base_s, base_d = python_loop_plan(planner, sb, db)
    same = np.array_equal(plan.src, np.array([r[:3] for r in base_s], dtype=np.int64)) and \
        np.array_equal(plan.dst, np.array([r[:3] for r in base_d], dtype=np.int64))
    if not same:
        raise RuntimeError("the Python loop and the compiler disagree: the benchmark would compare different work")
    for _ in range(100):
        planner.compile(sb, db)
    ours = _median_us(lambda: planner.compile(sb, db), args.runs)
    base = _median_us(lambda: python_loop_plan(planner, sb, db), args.baseline_runs)
    result = {
        "model": geometry.name, "tokens": args.tokens, "block_size": bs, "descriptors": plan.num_descriptors,
        "bytes": plan.nbytes, "fields_per_request": int(sum(t.num_pieces for t in planner._raw.values())),
        "runs": args.runs, "baseline_runs": args.baseline_runs, "median_us": round(ours, 2),
        "baseline_median_us": round(base, 2), "speedup": round(base / ours, 1), "setup_ms": round(setup_ms, 2),
        "outputs_identical": same,
    }
    if args.json:
        print_json(result)
        return 0
    print(f"{geometry.name}, {args.tokens} tokens, block {bs}: {plan.num_descriptors} descriptors, "
          f"{plan.nbytes / 2**20:.1f} MiB (per-peer setup {setup_ms:.1f} ms, once)")
    print(f"  hybridkv compile      median {ours:9.1f} us  over {args.runs} runs")
    print(f"  per-block Python loop median {base:9.1f} us  over {args.baseline_runs} runs (same output)")
    print(f"  speedup {base / ours:.1f}x")
    return 0
