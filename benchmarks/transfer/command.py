"""`hybridkv bench transfer`: one request between two processes over NIXL (UCX), four ways.

Same run, same bytes, same agents and connection:
(a) hybridkv: the Producer/Consumer path (fenced scheduler, the planner's
    int32 index pairs on prepped strided lists, merged by NIXL), timed from
    make+post to DONE;
(b) raw NIXL, one descriptor over a registered span of the same size (NIXL's own ceiling),
    timed like (a) from make+post to DONE, busy-polling;
(c) the descriptor list the vLLM 0.33 scheme would issue for the request: one
    per attention layer per block (K and V packed) plus conv and SSM per GDN
    layer, ids layer-major. Over hybridkv's block-major memory they merge only where
    one attention layer's blocks are adjacent (a model of a single attention layer),
    so NIXL mostly posts what the scheme issues; in vLLM's own layer-major
    memory, runs of consecutive block ids of one layer could merge.
(d) the physical ceiling: a plain copy of the same bytes in the same run (torch
    ``copy_`` from the producer's GPU to the consumer's, timed with CUDA events;
    numpy memcpy for DRAM).
Each is repeated and the median taken; each round runs every variant once, in a shuffled order and
after a short quiet time, so drift and after-effects hit all alike.

``--devices P,C`` puts the producer's memory on cuda:P and the consumer's on
cuda:C (each process sets its own device); ``--proto-log PATH`` turns on UCX's
protocol tables (UCX_PROTO_INFO=y) in both processes, keeps their console in
PATH and summarises which transports carried NIXL's reads (``transports``).

Here: the command (its options, their checks, the two processes started, the report printed); run it as
`hybridkv bench transfer` (or `python -m hybridkv.cli bench transfer`).
Each side's memory and the producer process are in :mod:`hybridkv.benchmarks.transfer.sides`; the
consumer's timed rounds in :mod:`hybridkv.benchmarks.transfer.measure`; the lists (b) and (c), how one
is posted and timed and the posting-cost fit in :mod:`hybridkv.benchmarks.transfer.posting`; (d) in
:mod:`hybridkv.benchmarks.transfer.copy`.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import secrets
import sys

from hybridkv.benchmarks.transfer.measure import _measure, print_schemes
from hybridkv.cli import CommandError, MissingExtra, bounded, print_json
from hybridkv.descriptors.planning import DescriptorPlanner
from hybridkv.transport.config import Pairing
from hybridkv.benchmarks.transfer.posting import parse_curve, parse_splits
from hybridkv.benchmarks.transfer.sides import _geometry, _producer_main, parse_devices

# Bounds. Tokens: Qwen3.5's native context; each of the two processes registers twice the request
# (its layout and the raw span), 17 GiB for qwen3.5-9b at the bound. Iterations: each is a full
# round of every variant, ~1 s on a CPU machine. Block size: tokens per block past any engine's page.
MAX_TOKENS = 262_144
MAX_ITERS = 1000
MAX_BLOCK = 1 << 16


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen3.5-9b", help="geometry preset (default qwen3.5-9b)")
    parser.add_argument("--tokens", type=bounded(int, MAX_TOKENS), default=8192, help="tokens of the one request")
    parser.add_argument("--layers", type=int, default=None,
                        help="scale the layer count down (a multiple of 4; default: all the preset's)")
    parser.add_argument("--block-size", type=bounded(int, MAX_BLOCK), default=64, help="tokens per block")
    parser.add_argument("--iters", type=bounded(int, MAX_ITERS), default=5,
                        help="timed rounds (each runs every variant once; the median is reported)")
    parser.add_argument("--mem", choices=("dram", "vram"), default="dram",
                        help="where both sides' memory is: host DRAM or GPU VRAM")
    parser.add_argument("--devices", default=None, metavar="P,C",
                        help="--mem vram: producer on cuda:P, consumer on cuda:C (default 0,0)")
    parser.add_argument("--proto-log", default=None, metavar="PATH",
                        help="UCX_PROTO_INFO=y in both processes, their console kept in PATH, transports summarised "
                             "(default: off)")
    parser.add_argument("--raw-splits", default="1", metavar="N[,N...]",
                        help="also post the raw span cut into N equal descriptors, for each N from 1 to 4096 (default "
                             "1: only the one-descriptor baseline); shows whether UCX overlaps descriptors")
    parser.add_argument("--posting-curve", default=None, metavar="N[,N...]",
                        help="also post N descriptors for each N (1 to 262,144): the raw span cut into N touching "
                             "pieces (does NIXL merge them?) and N pieces of --probe-bytes kept apart; thread CPU "
                             "of make + post, time to DONE and NIXL's posted count for each (default: off)")
    parser.add_argument("--settle-ms", type=float, default=20.0,
                        help="quiet time before each timed variant, for the control messages of the one before it, "
                             "0 to 10000 (default: 20.0)")
    parser.add_argument("--prime", choices=("on", "off"), default="on",
                        help="hybridkv's consumer primes the posting path with a READ of a few bytes once it asked "
                             "for the request (DataPlaneConfig.prime; transport/primer.py)")
    parser.add_argument("--read-notif", choices=("on", "off"), default="off",
                        help="hybridkv's READs carry a NIXL notification (TransportConfig.notify_reads)")
    parser.add_argument("--probe-bytes", type=int, default=64,
                        help="bytes per descriptor of the posting probe (the vllm-0.33 list and one descriptor, "
                             "posted with this length each, CPU of the posting thread timed), 1 to 1048576 "
                             "(default 64)")
    parser.add_argument("--spin-us", type=float, default=0.0,
                        help="hybridkv's consumer polls its READ back to back this long before yielding to its event "
                             "loop (DataPlaneConfig.spin_s), 0 to 1000000 (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    # Both sides cut pages alike, so the planner promises pages (and posts the prepped-list index
    # pairs of the compiler's affine fast path).
    parser.set_defaults(handler=run, planner=DescriptorPlanner(pairing=Pairing.PAGES))


def run(args: argparse.Namespace) -> int:
    if args.tokens <= 0 or args.iters <= 0:
        raise ValueError(f"--tokens {args.tokens} and --iters {args.iters}; expected positive ints")
    if args.block_size <= 0:
        raise ValueError(f"--block-size {args.block_size}; expected a positive number of tokens")
    parse_splits(args.raw_splits)
    parse_curve(args.posting_curve)
    if not 1 <= args.probe_bytes <= 1 << 20:
        raise ValueError(f"--probe-bytes {args.probe_bytes}; expected 1 to 1048576")
    if not 0 <= args.spin_us <= 1e6:
        raise ValueError(f"--spin-us {args.spin_us}; expected 0 to 1000000")
    if not 0 <= args.settle_ms <= 10_000:
        raise ValueError(f"--settle-ms {args.settle_ms}; expected 0 to 10000")
    # Here as well as in the producer: a bad --model or --layers is said at once, as one line,
    # not after a process start as the producer's failure.
    _geometry(args.model, args.layers)
    devices = parse_devices(args.devices, args.mem)
    if args.mem == "vram":
        import torch  # missing: main() names the extra

        if not torch.cuda.is_available():
            # The machine, not the input: exit 1 like `hybridkv demo --device cuda`.
            raise CommandError("--mem vram: torch sees no CUDA device")
        n = torch.cuda.device_count()
        if max(devices) >= n:
            raise ValueError(f"--devices {args.devices!r}; only {n} CUDA device(s) visible (indices 0..{n - 1})")
    _require_nixl()
    from hybridkv.transport import ucx_log
    from hybridkv.transport.env import apply_ucx_defaults

    # In the parent, so that the spawned producer inherits the same environment as the consumer.
    apply_ucx_defaults()
    set_proto = bool(args.proto_log) and "UCX_PROTO_INFO" not in os.environ
    if set_proto:
        os.environ["UCX_PROTO_INFO"] = "y"  # before either process creates a UCX context
    from hybridkv.transport.auth import new_token

    # Both processes are this run's: a fresh secret and one capability per request, handed over
    # in the spawn arguments (never a command line).
    args.secret = secrets.token_bytes(32)
    args.capabilities = [new_token() for _ in range(args.iters + 1)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    try:
        with ucx_log.console_to(args.proto_log):
            proc = ctx.Process(target=_producer_main, args=(vars(args) | {"handler": None}, out), daemon=True)
            proc.start()
            try:
                kind, addr = out.get(timeout=120)
                if kind == "invalid":
                    raise ValueError(addr)
                if kind == "error":
                    # The producer's failure ends the run; its traceback (for a bug report) goes under the line.
                    raise CommandError(f"the producer process failed: {addr}")
                report = asyncio.run(_measure(args, addr, out, devices))
            finally:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
    except BaseException:
        if args.proto_log:  # what both processes printed is in the log: show its end with the error
            with open(args.proto_log, errors="replace") as f:
                sys.stderr.writelines(f.readlines()[-80:])
        raise
    finally:
        if set_proto:
            del os.environ["UCX_PROTO_INFO"]
    report["transports"] = None
    if args.proto_log:
        with open(args.proto_log, errors="replace") as f:
            report["transports"] = ucx_log.summarize_transports(f.read())
    if args.json:
        print_json(report)
    else:
        _print(report)
    return 0


def _require_nixl() -> None:
    """Before any process starts: without NIXL, one line naming the extra, not the producer's failure."""
    from hybridkv.transport.nixl_shim import load_nixl

    try:
        load_nixl()
    except MissingExtra:
        raise
    except ImportError as exc:
        raise MissingExtra("NIXL", "transport", detail=str(exc)) from exc


def _print(rep: dict) -> None:
    where = f" cuda:{rep['devices'][0]} -> cuda:{rep['devices'][1]}" if rep["devices"] else ""
    print(f"{rep['model']}: one {rep['tokens']}-token request, {rep['bytes']:,} bytes "
          f"({rep['bytes'] / 2**20:.1f} MiB), {rep['mem'].upper()}{where}, 2 processes, NIXL UCX, "
          f"median of {rep['iters']}")
    print(f"  {'path':<26}{'posted':>8}{'GB/s':>10}{'x raw':>8}{'x copy':>8}")
    for name, posted, g, xr, xc in (
            ("(b) raw NIXL, one span", rep["raw_posted"], rep["raw_GBps"], 1.0, rep["raw_vs_copy"]),
            ("(a) hybridkv plan", rep["descriptors"], rep["hybridkv_GBps"], rep["ratio"], rep["hybridkv_vs_copy"]),
            ("(c) vllm-0.33 scheme", rep["vllm_scheme_posted"], rep["vllm_scheme_GBps"], rep["vllm_ratio"],
             rep["vllm_vs_copy"]),
            ("(d) copy ceiling", "-", rep["copy_GBps"], rep["copy_GBps"] / rep["raw_GBps"], 1.0)):
        print(f"  {name:<26}{posted!s:>8}{g:>10.2f}{xr:>8.2f}{xc:>8.3f}")
    print_schemes(rep)
    print(f"  hybridkv handed NIXL {rep['index_pairs']} index pairs; NIXL posted {rep['descriptors']} after merging;"
          f" the vllm-0.33 list has {rep['vllm_scheme_descriptors']}; copy: {rep['copy_kind']}")
    print(f"  make + post (median us): hybridkv {rep['post_us']['hybridkv']:.0f}, raw {rep['post_us']['raw']:.0f},"
          f" vllm-0.33 list with its id build {rep['post_us']['vllm_scheme']:.0f}"
          " (the rest of each time is waiting for DONE)")
    ps = rep["posting"]
    print(f"  posting thread CPU: {ps['per_descriptor_us']:.3f} us per descriptor + {ps['fixed_us']:.0f} us per"
          f" transfer; wire after posting: {ps['wire_per_descriptor_us']:.3f} us per descriptor"
          f" ({ps['from']})")
    print(f"  raw one span with a NIXL notification: {rep['raw_notif_GBps']:.2f} GB/s"
          f" (hybridkv's READs carry one: {rep['read_notif']})")
    if len(rep["raw_split_GBps"]) > 1:
        print("  raw span cut into N descriptors: " + ", ".join(
            f"N={n}: {g:.2f} GB/s" for n, g in rep["raw_split_GBps"].items()))
    if rep.get("posting_curve"):
        print(f"  posting curve (median; CPU = the posting thread's make + post, landed = post to DONE):")
        print(f"    {'N':>8} | {'touching: posted':>16}{'CPU us':>11}{'landed us':>11} | "
              f"{'apart: posted':>13}{'CPU us':>11}{'landed us':>11}{'CPU us/desc':>12}")
        for n, row in rep["posting_curve"].items():
            a, g = row["touching"], row["apart"]
            print(f"    {int(n):>8,} | {a['posted']:>16,}{a['post_cpu_us']:>11,.0f}{a['landed_us']:>11,.0f} | "
                  f"{g['posted']:>13,}{g['post_cpu_us']:>11,.0f}{g['landed_us']:>11,.0f}"
                  f"{g['post_cpu_us'] / int(n):>12.3f}")
    t = rep.get("transports")
    if t:
        print(f"  UCX transports on NIXL's data path: {', '.join(t['tls']) or 'none seen'}")
        for line in t["data_path"]:
            print(f"    {line}")
