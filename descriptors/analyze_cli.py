"""`hybridkv analyze`: descriptors each scheme issues for one request, side by side."""

from __future__ import annotations

import argparse

# Per-descriptor cost and link bandwidth of the transfer-time estimate: NIXL/UCX over
# CMA on a 2-vCPU machine, unmerged descriptors (docs/background/nixl.md section 2.1).
DEFAULT_PER_DESC_US = 2.0
DEFAULT_LINK_GBPS = 10.0


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
                        help="per-descriptor cost for the time estimate (us)")
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

    if args.per_desc_us < 0 or args.link_gbps <= 0:
        raise ValueError(f"--per-desc-us must be >= 0 and --link-gbps > 0, got {args.per_desc_us}, {args.link_gbps}")
    geometry = load_geometry(args)
    w = Workload(geometry=geometry, tokens=args.tokens, block_size=args.block_size, tp_prefill=args.tp_prefill,
                 tp_decode=args.tp_decode, fragmentation=args.fragmentation,
                 kernel_block_size=args.kernel_block_size)
    counts = count_all(w)
    ours = next(c for c in counts if c.scheme is Scheme.HYBRIDKV)
    rows = []
    for c in counts:
        est_ms = (c.descriptors * args.per_desc_us * 1e-6 + c.bytes / (args.link_gbps * 1e9)) * 1e3
        rows.append({"name": c.scheme.value, "descriptors": c.descriptors, "bytes": c.bytes, "regions": c.regions,
                     "mean_descriptor_bytes": c.bytes // max(c.descriptors, 1),
                     "ratio_to_hybridkv": c.descriptors / max(ours.descriptors, 1), "est_ms": est_ms})
    workload = {"model": geometry.name, "tokens": w.tokens, "block_size": w.effective_block_size,
                "tp_prefill": w.tp_prefill, "tp_decode": w.tp_decode, "fragmentation": w.fragmentation,
                "kernel_block_size": args.kernel_block_size, "per_desc_us": args.per_desc_us,
                "link_gbps": args.link_gbps}
    if args.json:
        print_json({"workload": workload, "schemes": rows})
        return 0
    _print_table(workload, rows)
    return 0


def _print_table(workload: dict, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (f"{workload['model']}: {workload['tokens']} tokens, block {workload['block_size']}, "
             f"TP {workload['tp_prefill']}->{workload['tp_decode']}, fragmentation {workload['fragmentation']}")
    table = Table(title=title)
    for col in ("scheme", "descriptors", "MiB", "mean desc", "regions", "x hybridkv",
                f"est. ms ({workload['per_desc_us']} us/desc, {workload['link_gbps']} GB/s)"):
        table.add_column(col, justify="left" if col == "scheme" else "right")
    for r in rows:
        table.add_row(r["name"], f"{r['descriptors']:,}", f"{r['bytes'] / 2**20:,.1f}",
                      _size(r["mean_descriptor_bytes"]), str(r["regions"]), f"{r['ratio_to_hybridkv']:.1f}",
                      f"{r['est_ms']:.2f}")
    Console(width=140).print(table)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
