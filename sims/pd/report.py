"""Tables, JSON and the Pareto plot of `hybridkv sim pd`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .sweep import SweepResult


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def sweep_table(result: SweepResult) -> Table:
    cfg = result.config
    title = (f"{result.name}: {cfg.request.transfer_descriptors:,} descriptors, "
             f"{cfg.request.transfer_bytes / 2**20:,.0f} MiB, {cfg.transfer_s * 1e3:.2f} ms per transfer; "
             f"{cfg.decode.ranks * cfg.decode.endpoints * cfg.requests_per_rank():,} requests fit in decode; "
             f"{cfg.total_gpus} GPUs")
    table = Table(title=title, title_justify="left")
    for col in ("concurrency", "tok/s/GPU", "out tok/s/GPU", "tok/s/user", "TTFT ms", "ITL ms",
                "xfer ms", "xfer/TTFT", "note"):
        table.add_column(col, justify="left" if col == "note" else "right")
    for p in result.points:
        note = "decode cache full: requests waited" if p.capacity_bound else ""
        table.add_row(f"{p.concurrency:,}", f"{p.tokens_per_s_per_gpu:,.0f}", f"{p.output_tokens_per_s_per_gpu:,.0f}",
                      f"{p.tokens_per_s_per_user:,.1f}", _ms(p.ttft_s), f"{p.itl_s * 1e3:.2f}",
                      _ms(p.transfer_s), f"{p.transfer_share:.1%}", note)
    for c in result.skipped:
        table.add_row(f"{c:,}", "-", "-", "-", "-", "-", "-", "-", "not run: decode cache exhausted")
    return table


def comparison_table(results: Sequence[SweepResult], baseline: SweepResult) -> Table:
    """tok/s/GPU of every variant per concurrency, as a ratio to `baseline` from the same run."""
    table = Table(title=f"tok/s/GPU, ratio to {baseline.name}", title_justify="left")
    table.add_column("concurrency", justify="right")
    for r in results:
        table.add_column(r.name, justify="right")
    base = {p.concurrency: p.tokens_per_s_per_gpu for p in baseline.points}
    concurrencies = sorted({p.concurrency for r in results for p in r.points})
    for c in concurrencies:
        row = [f"{c:,}"]
        for r in results:
            got = {p.concurrency: p.tokens_per_s_per_gpu for p in r.points}.get(c)
            if got is None:
                row.append("-")
            elif c in base and base[c] > 0:
                row.append(f"{got:,.0f} ({got / base[c]:.3f}x)")
            else:
                row.append(f"{got:,.0f}")
        table.add_row(*row)
    return table


def print_report(results: Sequence[SweepResult], console: Console) -> None:
    for r in results:
        console.print(sweep_table(r))
    if len(results) > 1:
        baseline = next((r for r in results if r.name.endswith("vllm-0.33 sync")), results[0])
        console.print(comparison_table(results, baseline))


def as_json(results: Sequence[SweepResult]) -> dict[str, Any]:
    """`points` is the first (default) variant's; `variants` holds every variant's."""
    variants = []
    for r in results:
        cfg = r.config
        variants.append({
            "name": r.name,
            "recipe": r.recipe,
            "scheme": r.scheme,
            "scheduling": cfg.scheduling.value,
            "descriptors_per_request": cfg.request.transfer_descriptors,
            "transfer_bytes_per_request": cfg.request.transfer_bytes,
            "transfer_s": cfg.transfer_s,
            "decode_blocks_per_request": cfg.request.decode_blocks,
            "decode_blocks_per_rank": cfg.decode.blocks_per_rank,
            "total_gpus": cfg.total_gpus,
            "cut_at": r.cut_at,
            "skipped": list(r.skipped),
            "points": [p.as_json() for p in r.points],
        })
    return {"points": variants[0]["points"] if variants else [], "variants": variants}


def plot_pareto(results: Sequence[SweepResult], out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(out)
    if path.parent and not path.parent.exists():
        raise ValueError(f"--plot {out}: folder {path.parent} does not exist")
    fig, ax = plt.subplots(figsize=(8, 5.5))
    # Variants often coincide (a scheme change that costs little): vary the dash and marker
    # so a curve drawn over another stays visible.
    styles = [("-", "o"), ("--", "s"), ("-.", "^"), (":", "D")]
    for i, r in enumerate(results):
        xs = [p.tokens_per_s_per_user for p in r.points]
        ys = [p.tokens_per_s_per_gpu for p in r.points]
        dash, marker = styles[i % len(styles)]
        (line,) = ax.plot(xs, ys, linestyle=dash, marker=marker, markersize=5, label=r.name)
        for p in r.points:
            if p.capacity_bound:
                ax.plot([p.tokens_per_s_per_user], [p.tokens_per_s_per_gpu], marker="x", markersize=11,
                        color=line.get_color())
        if r.points:
            for p in (r.points[0], r.points[-1]):
                ax.annotate(f"c={p.concurrency}", (p.tokens_per_s_per_user, p.tokens_per_s_per_gpu),
                            textcoords="offset points", xytext=(4, 4), fontsize=7, color=line.get_color())
    ax.set_xlabel("output tokens/s per user")
    ax.set_ylabel("total tokens/s per GPU")
    ax.set_title("Simulated disaggregated serving (x: decode cache full)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
