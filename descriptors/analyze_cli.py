"""`hybridkv analyze`: descriptors each scheme issues for one request, side by side.

With whether posting them matters: the ids one posting thread builds, what posting them costs on that
thread, and the decode step it competes with."""

from __future__ import annotations

import argparse

# Posting cost on the thread that posts, per descriptor that cannot merge and per transfer, and where
# it was measured: a GPU host's (the deployments this is for); the CPU box's figure is in the note.
DEFAULT_PER_DESC_US = 4.95
DEFAULT_PER_TRANSFER_US = 60.0
POSTING_SOURCE = ("measured: `hybridkv bench transfer --mem vram --posting-curve` on one H100 (two processes, NIXL UCX "
                  "over cuda_ipc): 4.95 us of posting-thread CPU per descriptor that cannot merge (4.93-5.52 us from 64 "
                  "to 131K) and ~60 us per transfer (docs/benchmarks/transfer.md, 'Posting curve')")
GPU_HOST_NOTE = ("hosts differ: the 2-core CPU development box (DRAM, UCX over CMA) gave ~2 us per descriptor + ~85 us; "
                 "RDMA hosts are not measured; give your host's figures with --per-desc-us and --per-transfer-us")
# The step budget a posting competes with: one decode step of `DEFAULT_STEP_MS`, carrying `DEFAULT_BATCH`
# requests of `DEFAULT_OSL` output tokens each, so batch / osl new requests (transfers) arrive per step.
DEFAULT_STEP_MS = 10.0
DEFAULT_BATCH = 256
DEFAULT_OSL = 1024
STEP_SOURCE = ("assumed: a large MoE's decode step at high batch; the simulated seed deployment (Qwen3.5-397B, DEP8, "
               "8,192/1,024) steps in ~9-14 ms (docs/simulators.md)")
BATCH_SOURCE = "assumed: the seed's 2,048 users over DEP8, 256 running requests per decode rank (docs/background/seed.md)"
OSL_SOURCE = "cited: the seed's OSL 1,024 (docs/background/seed.md)"
# Link bandwidth of the (older) transfer-time estimate column.
DEFAULT_LINK_GBPS = 10.0
MAX_STEP_MS = 1e6
MAX_BATCH = 1 << 20


# Bounds of the sizes (argparse refuses more, naming the bound). Tokens: 64x the longest context of
# any preset (Qwen3.5: 262,144 native); past that the request is no model's. TP: as many GPUs as one
# NVL72 domain, more than any model's KV heads can split over. Block sizes: 1 GiB of tokens per
# block is beyond any engine's page.
MAX_TOKENS = 1 << 24
MAX_TP = 72
MAX_BLOCK = 1 << 20
# The time estimate's figures: a second per descriptor and 100 TB/s are past any real NIC.
MAX_PER_DESC_US = 1e6
MAX_LINK_GBPS = 1e5


def register(parser: argparse.ArgumentParser) -> None:
    from hybridkv.cli import bounded

    parser.description = "Count the transfer descriptors each engine's scheme issues for one request."
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="a preset name (default: qwen3.5-397b-a17b)")
    src.add_argument("--config", default=None,
                     help="a Hugging Face config.json (or its directory) instead of a preset (default: none)")
    parser.add_argument("--tokens", type=bounded(int, MAX_TOKENS), default=8192, help="prompt tokens of the request")
    parser.add_argument("--block-size", type=bounded(int, MAX_BLOCK), default=None,
                        help="engine block size in tokens, a multiple of 16 (default: the HMA-aligned size)")
    parser.add_argument("--tp-prefill", type=bounded(int, MAX_TP), default=1, help="tensor-parallel size of prefill")
    parser.add_argument("--tp-decode", type=bounded(int, MAX_TP), default=1, help="tensor-parallel size of decode")
    parser.add_argument("--kernel-block-size", type=bounded(int, MAX_BLOCK), default=None,
                        help="attention kernel block size; vllm-0.33 issues one descriptor per kernel block "
                             "(default: the logical block, e.g. FlashAttention; FlashInfer splits to 16)")
    parser.add_argument("--ssm-dtype", choices=("float32", "bfloat16"), default=None,
                        help="dtype of the GDN SSM state (default: the preset's or config's)")
    parser.add_argument("--fragmentation", type=float, default=1.0,
                        help="fraction of consecutive block pairs not adjacent in memory, 0 to 1 (1.0: none adjacent)"
                             " (default: 1.0)")
    parser.add_argument("--per-desc-us", type=bounded(float, MAX_PER_DESC_US), default=DEFAULT_PER_DESC_US,
                        help="posting-thread CPU per descriptor that cannot merge, us (default: 4.95, measured on "
                             "one H100 over cuda_ipc; other hosts differ)")
    parser.add_argument("--per-transfer-us", type=bounded(float, MAX_PER_DESC_US), default=DEFAULT_PER_TRANSFER_US,
                        help="posting-thread CPU per transfer, us (default: 60.0, same measurement)")
    parser.add_argument("--step-ms", type=bounded(float, MAX_STEP_MS), default=DEFAULT_STEP_MS,
                        help="decode step time the posting competes with, ms (default: 10.0, assumed: the simulated "
                             "seed deployment steps in ~9-14 ms)")
    parser.add_argument("--decode-batch", type=bounded(int, MAX_BATCH), default=DEFAULT_BATCH,
                        help="running requests per decode rank (default: 256, the seed's 2,048 users over DEP8)")
    parser.add_argument("--osl", type=bounded(int, MAX_TOKENS), default=DEFAULT_OSL,
                        help="output tokens per request: batch / osl transfers arrive per decode step "
                             "(default: 1024, the seed's)")
    parser.add_argument("--link-gbps", type=bounded(float, MAX_LINK_GBPS), default=DEFAULT_LINK_GBPS,
                        help="link bandwidth for the time estimate (GB/s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def load_geometry(args: argparse.Namespace):
    from hybridkv.layout.hf_config import load_hf_config
    from hybridkv.layout.presets import get_preset

    if args.config:
        return load_hf_config(args.config, ssm_dtype=args.ssm_dtype)
    return get_preset(args.model or "qwen3.5-397b-a17b", ssm_dtype=args.ssm_dtype)


def run(args: argparse.Namespace) -> int:
    from hybridkv.cli import print_json

    from .schemes import Scheme, Workload, count_all

    if args.per_desc_us < 0 or args.per_transfer_us < 0 or args.link_gbps <= 0:
        raise ValueError(f"--per-desc-us and --per-transfer-us must be >= 0 and --link-gbps > 0, got "
                         f"{args.per_desc_us}, {args.per_transfer_us}, {args.link_gbps}")
    if not args.step_ms > 0:
        raise ValueError(f"--step-ms {args.step_ms}: expected a decode step time > 0 ms")
    for flag, value in (("--decode-batch", args.decode_batch), ("--osl", args.osl)):
        if value < 1:
            raise ValueError(f"{flag} {value}: expected an integer >= 1")
    geometry = load_geometry(args)
    w = Workload(geometry=geometry, tokens=args.tokens, block_size=args.block_size, tp_prefill=args.tp_prefill,
                 tp_decode=args.tp_decode, fragmentation=args.fragmentation,
                 kernel_block_size=args.kernel_block_size)
    counts = count_all(w)
    ours = next(c for c in counts if c.scheme is Scheme.HYBRIDKV)
    per_step = args.decode_batch / args.osl  # transfers a decode rank takes in per step, in steady state
    rows = []
    for c in counts:
        est_ms = (c.descriptors * args.per_desc_us * 1e-6 + c.bytes / (args.link_gbps * 1e9)) * 1e3
        posting = {kind: (args.per_transfer_us + n * args.per_desc_us) / 1e3
                   for kind, n in (("ids", c.per_posting_rank), ("merged", c.nixl_posted_per_posting_rank))}
        poster = c.poster
        # Decode-side posting competes with the decode step: on it (the step waits) or on a thread beside it
        # (which must keep up with the transfers arriving). Prefill-side posting is not on the decode budget.
        share = ({kind: ms * per_step / args.step_ms for kind, ms in posting.items()}
                 if poster.side.value == "decode" else None)
        rows.append({"name": c.scheme.value, "descriptors": c.descriptors, "bytes": c.bytes, "regions": c.regions,
                     "mean_descriptor_bytes": c.bytes // max(c.descriptors, 1),
                     "ratio_to_hybridkv": c.descriptors / max(ours.descriptors, 1), "est_ms": est_ms,
                     "per_decode_rank": c.per_decode_rank, "per_prefill_rank": c.per_prefill_rank,
                     "bytes_per_decode_rank": c.bytes_per_decode_rank,
                     "posted_by": {"side": poster.side.value, "on_step": poster.on_step, "where": poster.where},
                     "per_posting_rank": c.per_posting_rank,
                     "nixl_posted_per_posting_rank": c.nixl_posted_per_posting_rank,
                     "posting_ms": posting, "step_share": share})
    workload = {"model": geometry.name, "tokens": w.tokens, "block_size": w.effective_block_size,
                "tp_prefill": w.tp_prefill, "tp_decode": w.tp_decode, "fragmentation": w.fragmentation,
                "kernel_block_size": args.kernel_block_size, "per_desc_us": args.per_desc_us,
                "link_gbps": args.link_gbps}
    costs = {"per_descriptor_us": args.per_desc_us, "per_transfer_us": args.per_transfer_us,
             "source": POSTING_SOURCE if _default_posting(args) else "given on the command line",
             "gpu_host_note": GPU_HOST_NOTE}
    budget = {"decode_step_ms": args.step_ms, "decode_batch": args.decode_batch, "osl": args.osl,
              "transfers_per_step": per_step,
              "sources": {"decode_step_ms": STEP_SOURCE if args.step_ms == DEFAULT_STEP_MS else "given",
                          "decode_batch": BATCH_SOURCE if args.decode_batch == DEFAULT_BATCH else "given",
                          "osl": OSL_SOURCE if args.osl == DEFAULT_OSL else "given"}}
    if args.json:
        print_json({"workload": workload, "posting_cost": costs, "budget": budget, "schemes": rows})
        return 0
    _print_table(workload, costs, budget, rows)
    return 0


def _default_posting(args: argparse.Namespace) -> bool:
    return args.per_desc_us == DEFAULT_PER_DESC_US and args.per_transfer_us == DEFAULT_PER_TRANSFER_US


def _where(row: dict) -> str:
    by = row["posted_by"]
    return f"{by['side']} {'step' if by['on_step'] else 'thread'}"


def _ms(posting: dict) -> str:
    ids, merged = posting["ids"], posting["merged"]
    return f"{ids:,.2f}" if merged == ids else f"{merged:,.2f}-{ids:,.2f}"


def _share(share: dict | None) -> str:
    if share is None:
        return "not on decode"
    ids, merged = share["ids"], share["merged"]
    return f"{ids:.1%}" if merged == ids else f"{merged:.1%}-{ids:.1%}"


def _print_table(workload: dict, costs: dict, budget: dict, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    tp = f"TP {workload['tp_prefill']}->{workload['tp_decode']}"
    kernel = workload["kernel_block_size"]
    title = (f"{workload['model']}: {workload['tokens']} tokens, block {workload['block_size']}"
             f"{f', kernel block {kernel}' if kernel else ''}, {tp}, fragmentation {workload['fragmentation']}")
    table = Table(title=title)
    for col in ("scheme", "descriptors", "x hybridkv", "posted by", "ids per posting rank", "NIXL posts",
                "posting ms", "share of decode", "MiB per decode rank",
                f"est. ms ({workload['per_desc_us']} us/desc, {workload['link_gbps']} GB/s)"):
        table.add_column(col, justify="left" if col in ("scheme", "posted by") else "right")
    for r in rows:
        table.add_row(r["name"], f"{r['descriptors']:,}", f"{r['ratio_to_hybridkv']:.1f}", _where(r),
                      f"{r['per_posting_rank']:,}", f"{r['nixl_posted_per_posting_rank']:,}", _ms(r["posting_ms"]),
                      _share(r["step_share"]), f"{r['bytes_per_decode_rank'] / 2**20:,.1f}", f"{r['est_ms']:.2f}")
    console = Console(width=160)
    console.print(table)
    console.print(
        f"descriptors: totals over every (prefill rank, decode rank) read; ids per posting rank: what one posting "
        f"thread builds (per decode rank for vLLM and hybridkv, per prefill rank for SGLang and Mooncake); NIXL "
        f"posts: after merging pieces that touch on both sides (vLLM 0.33's kernel blocks of a logical block at "
        f"equal TP), so posting ms reads merged-unmerged.\n"
        f"posting: {costs['per_transfer_us']:g} us + {costs['per_descriptor_us']:g} us per descriptor "
        f"({costs['source']}). {costs['gpu_host_note']}.\n"
        f"share of decode: posting x {budget['transfers_per_step']:.3g} transfers per step "
        f"({budget['decode_batch']} requests / {budget['osl']} output tokens) over a {budget['decode_step_ms']:g} ms "
        f"step: on the step, the time the step grows; on a thread, how busy that thread is (past 100% it falls "
        f"behind). Step: {budget['sources']['decode_step_ms']}.")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
