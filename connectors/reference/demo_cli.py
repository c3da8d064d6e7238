"""`hybridkv demo`: disaggregated prefill -> decode of a small hybrid model over NIXL, checked token by token."""

from __future__ import annotations

import argparse

from hybridkv.cli import CommandError, bounded, print_json

from .demo import MAX_ASYNC_DEPTH

FAULTS = ("drop-transfer", "kill-decode", "late-completion", "stall-prefill")
# Bounds of the sizes. Requests: each is prefilled, moved and decoded for real, a few per second
# on a CPU; 4,096 already needs a --timeout far above the default. Prompts and chunks: 4,096 tokens,
# 4x the cuda default, whose pools are sized from --max-prompt. Timeout: a day.
MAX_REQUESTS = 4096
MAX_PROMPT = 4096
MAX_TIMEOUT_S = 86_400.0


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Disaggregated prefill -> decode of a small Qwen3.5-shaped hybrid model over NIXL, "
                          "compared token by token with an aggregated run.")
    parser.add_argument("--requests", type=bounded(int, MAX_REQUESTS), default=32,
                        help="requests sent through prefill -> decode")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model weights and the prompts")
    parser.add_argument("--async-depth", type=int, default=1,
                        help=f"steps the scheduler runs ahead of the worker (0 to {MAX_ASYNC_DEPTH})")
    parser.add_argument("--policy", choices=("fenced", "none"), default="fenced",
                        help="fence policy of both engines (none shows what breaks)")
    parser.add_argument("--failure-policy", choices=("recompute", "fail"), default="recompute",
                        help="what the decode side does with a request whose transfer failed")
    parser.add_argument("--inject", action="append", default=[], choices=FAULTS,
                        help="inject a real fault (repeatable; default: none)")
    parser.add_argument("--timeout", type=bounded(float, MAX_TIMEOUT_S), default=240.0,
                        help="seconds the whole run (aggregated baseline, then disaggregated) may take "
                             "before it stops and says what is stuck")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the model, KV pages and GDN states in VRAM, moved GPU memory to GPU memory "
                             "by NIXL (prefill and decode processes on --devices)")
    parser.add_argument("--devices", default="0,0", metavar="P,D",
                        help="CUDA devices of the prefill and decode processes (0,0: both on one GPU)")
    parser.add_argument("--model", default=None,
                        help="tiny (the CPU default) or a Qwen3.5 preset: qwen3.5-0.8b (the cuda default), "
                             "qwen3.5-2b")
    parser.add_argument("--max-prompt", type=bounded(int, MAX_PROMPT), default=None,
                        help="longest prompt in tokens (default 120 on cpu, 1024 on cuda)")
    parser.add_argument("--chunk-size", type=bounded(int, MAX_PROMPT), default=None,
                        help="chunked-prefill tokens per step (default 32 on cpu, 256 on cuda)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from .demo import DemoOptions, run_demo

    o = DemoOptions(requests=args.requests, seed=args.seed, async_depth=args.async_depth, policy=args.policy,
                    failure_policy=args.failure_policy, inject=tuple(args.inject), timeout_s=args.timeout,
                    **_device_options(args))
    try:
        report = run_demo(o)
    except TimeoutError as exc:
        # The user's --timeout ran out: the message already says what was stuck, a traceback adds nothing.
        raise CommandError(str(exc)) from exc
    bad = report.mismatches or report.leaked_blocks or report.byte_mismatches
    if args.json:
        print_json({k: v for k, v in vars(report).items() if k != "extra"})
    else:
        _print(report)
    return 1 if bad else 0


def _device_options(args: argparse.Namespace) -> dict:
    """What --device changes: on cuda a Qwen3.5-sized model, longer prompts, larger chunks, pools to fit."""
    from .model import MODELS

    try:
        devices = tuple(int(x) for x in args.devices.split(","))
    except ValueError:
        devices = ()
    if len(devices) != 2:
        raise ValueError(f"--devices {args.devices!r}; expected two CUDA device indices, e.g. 0,1")
    cuda = args.device == "cuda"
    model = args.model or ("qwen3.5-0.8b" if cuda else "tiny")
    if model not in MODELS:
        raise ValueError(f"--model {model!r}; expected one of {', '.join(MODELS)}")
    if cuda:
        import torch

        if not torch.cuda.is_available():
            raise CommandError("--device cuda: torch sees no CUDA device")
        if max(devices) >= torch.cuda.device_count():
            raise ValueError(f"--devices {args.devices}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    max_prompt = args.max_prompt or (1024 if cuda else 120)
    opts = dict(device=args.device, devices=devices, model=model, max_prompt=max_prompt,
                chunk_size=args.chunk_size or (256 if cuda else 32))
    if cuda:
        # Room for every running request's longest prompt and output twice over (frees are
        # deferred behind in-flight steps); the CPU demo keeps its small pools, where races show.
        per_request = -(-(max_prompt + 17) // 16)
        # Steps are longer than the tiny model's: a 4 s lease (the CPU demo's, short for kill-decode)
        # would lapse while the decode side still waits its turn.
        opts.update(attention_blocks=max(96, 2 * 8 * per_request), min_prompt=16, lease_s=20.0)
    return opts


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
        ("model / device", f"{r.model} / {r.device}"),
        ("pages compared byte for byte (mismatched)", f"{r.pages_checked} ({r.pages_mismatched})"),
        ("requests with mismatched bytes", str(r.byte_mismatches)),
        ("output tokens/s (disaggregated)", f"{r.tokens_per_s:.1f}"),
    ]
    a = r.aggregated
    if a:
        rows += [("aggregated: TTFT / ITL / tokens/s",
                  f"{a.get('ttft_ms', 0):.1f} ms / {a.get('itl_ms', 0):.1f} ms / {a.get('tokens_per_s', 0):.1f}")]
    if r.transfer_GBps_each:
        g = r.transfer_GBps_each
        rows += [("GB/s per transfer (min / median / max)", f"{g['min']} / {g['median']} / {g['max']}")]
    if r.fence_wait_ms:
        f = r.fence_wait_ms
        rows += [("fence wait per import (mean / max)", f"{f['mean']} ms / {f['max']} ms")]
    rows += [("steps: ahead of results / overlapping / launched", str(r.steps_overlapped))]
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
    if r.mismatches:
        Console().print(f"[red]mismatched requests: {', '.join(r.mismatched)}[/red]")
        Console().print(f"recomputed: {r.extra['recomputed_ids']}; failed: {r.extra['errors']}")
    if r.byte_mismatches:
        Console().print(f"[red]requests whose imported bytes differ from the export: "
                        f"{', '.join(r.extra['byte_mismatched'])}[/red]")
