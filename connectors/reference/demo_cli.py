"""`hybridkv demo`: disaggregated prefill -> decode of a small hybrid model over NIXL, checked token by token."""

from __future__ import annotations

import argparse
import json

from hybridkv.cli import CommandError

from .demo import MAX_ASYNC_DEPTH

FAULTS = ("drop-transfer", "kill-decode", "late-completion", "stall-prefill")


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Disaggregated prefill -> decode of a small Qwen3.5-shaped hybrid model over NIXL, "
                          "compared token by token with an aggregated run.")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-depth", type=int, default=1,
                        help=f"steps the scheduler runs ahead of the worker (0 to {MAX_ASYNC_DEPTH})")
    parser.add_argument("--policy", choices=("fenced", "none"), default="fenced",
                        help="fence policy of both engines (none shows what breaks)")
    parser.add_argument("--failure-policy", choices=("recompute", "fail"), default="recompute")
    parser.add_argument("--inject", action="append", default=[], choices=FAULTS,
                        help="inject a real fault (repeatable)")
    parser.add_argument("--timeout", type=float, default=240.0,
                        help="seconds the whole run (aggregated baseline, then disaggregated) may take "
                             "before it stops and says what is stuck")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from .demo import DemoOptions, run_demo

    o = DemoOptions(requests=args.requests, seed=args.seed, async_depth=args.async_depth, policy=args.policy,
                    failure_policy=args.failure_policy, inject=tuple(args.inject), timeout_s=args.timeout)
    try:
        report = run_demo(o)
    except TimeoutError as exc:
        # The user's --timeout ran out: the message already says what was stuck, a traceback adds nothing.
        raise CommandError(str(exc)) from exc
    bad = report.mismatches or report.leaked_blocks
    if args.json:
        out = {k: v for k, v in vars(report).items() if k != "extra"}
        print(json.dumps(out))
    else:
        _print(report)
    return 1 if bad else 0


def _print(r) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"hybridkv demo: {r.requests} requests, prefill -> decode over {r.transport.upper()}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("requests / tokens", f"{r.requests} / {r.tokens}"),
        ("mismatches vs aggregated", str(r.mismatches)),
        ("failed / recomputed / re-sent", f"{r.failed} / {r.recomputed} / {r.resent}"),
        ("leaked blocks", str(r.leaked_blocks)),
        ("descriptors per request (NIXL posted)", f"{r.descriptors_per_request:.1f}"),
        ("  vllm-0.33 scheme, same requests", f"{r.vllm_033_descriptors_per_request:.1f}"),
        ("bytes moved", f"{r.bytes_moved / 2**20:.2f} MiB"),
        ("transfer GB/s", f"{r.transfer_GBps:.3f}"),
        ("TTFT mean", f"{r.ttft_ms:.1f} ms"),
        ("inter-token latency mean", f"{r.itl_ms:.1f} ms"),
        ("async depth / fence policy", f"{r.async_depth} / {r.policy}"),
        ("processes", str(r.processes)),
        ("faults injected", f"{r.faults_injected} {r.faults}"),
        ("wall (disaggregated / aggregated)", f"{r.wall_s:.1f} s / {r.aggregated_s:.1f} s"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
    if r.mismatches:
        Console().print(f"[red]mismatched requests: {', '.join(r.mismatched)}[/red]")
