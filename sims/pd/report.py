"""Tables, JSON and the Pareto plot of `hybridkv sim pd`: every figure as mean ± spread over seeds."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .params import METRICS, Arrivals
from .sweep import PointSummary, SensitivityRow, SweepResult, paired_ratio


def _load(arrivals: Arrivals, load: float) -> str:
    return f"{load:,.0f}" if arrivals is Arrivals.CLOSED else f"{load:,.3g}/s"


def _pm(p: PointSummary, metric: str, fmt: str, scale: float = 1.0) -> str:
    return f"{format(p.mean(metric) * scale, fmt)} ± {format(p.spread(metric) * scale, fmt)}"


def sweep_table(result: SweepResult) -> Table:
    cfg = result.config
    desc, nbytes, blocks = cfg.typical()
    seeds = len(result.points[0].runs) if result.points else 0
    title = (f"{result.name}: {desc:,} descriptors, {nbytes / 2**20:,.0f} MiB, {cfg.typical_transfer_s() * 1e3:.2f} ms "
             f"per transfer alone (mean lengths); {blocks} decode blocks of {cfg.decode.blocks_per_rank:,} per rank; "
             f"{cfg.total_gpus} GPUs; mean ± spread over {seeds} seeds")
    table = Table(title=title, title_justify="left")
    head = "users" if result.arrivals is Arrivals.CLOSED else "req/s"
    for col in (head, "tok/s/GPU", "out tok/s/GPU", "tok/s/user", "TTFT ms", "ITL ms", "xfer ms", "post ms",
                "xfer/TTFT", "preempt", "note"):
        table.add_column(col, justify="left" if col == "note" else "right")
    for p in result.points:
        notes = ["decode cache full: requests waited"] if p.capacity_bound else []
        if result.arrivals is Arrivals.OPEN and p.mean("backlog_growth") > 0.05 * p.runs[0].completed:
            notes.append(f"overloaded: the queue grew by {p.mean('backlog_growth'):,.0f} in the window")
        note = "; ".join(notes)
        table.add_row(_load(result.arrivals, p.load), _pm(p, "tokens_per_s_per_gpu", ",.0f"),
                      _pm(p, "output_tokens_per_s_per_gpu", ",.0f"), _pm(p, "tokens_per_s_per_user", ",.1f"),
                      _pm(p, "ttft_s", ",.1f", 1e3), _pm(p, "itl_s", ".2f", 1e3), _pm(p, "transfer_s", ",.2f", 1e3),
                      f"{p.mean('posting_s') * 1e3:.2f}", f"{p.mean('transfer_share'):.1%}",
                      f"{p.mean('preemptions'):,.0f}", note)
    for c in result.skipped:
        table.add_row(_load(result.arrivals, c), *["-"] * 9, "not run: decode cache exhausted")
    return table


def comparison_table(results: Sequence[SweepResult], baseline: SweepResult) -> Table:
    """tok/s/GPU of every variant per load, with its ratio to `baseline` taken seed by seed."""
    table = Table(title=f"tok/s/GPU (mean ± spread), ratio to {baseline.name} seed by seed", title_justify="left")
    table.add_column("load", justify="right")
    for r in results:
        table.add_column(r.name, justify="right")
    base = {p.load: p for p in baseline.points}
    for load in sorted({p.load for r in results for p in r.points}):
        row = [_load(baseline.arrivals, load)]
        for r in results:
            got = {p.load: p for p in r.points}.get(load)
            if got is None:
                row.append("-")
                continue
            cell = _pm(got, "tokens_per_s_per_gpu", ",.0f")
            if load in base and r is not baseline:
                m, s = paired_ratio(base[load], got)
                cell += f" ({m:.3f} ± {s:.3f}x)"
            row.append(cell)
        table.add_row(*row)
    return table


def sensitivity_table(rows: Sequence[SensitivityRow], schemes: Sequence[str], arrivals: Arrivals) -> Table:
    table = Table(title=f"sensitivity: tok/s/GPU (mean ± spread over seeds); gain = {schemes[-1]} / {schemes[0]} "
                        "seed by seed", title_justify="left")
    for col in ("setting", "load", *schemes, "gain", f"xfer ms {schemes[0]}", f"TTFT ms {schemes[0]}"):
        table.add_column(col, justify="left" if col == "setting" else "right")
    for row in rows:
        m, s = paired_ratio(row.points[0], row.points[-1])
        table.add_row(row.setting.label, _load(arrivals, row.load),
                      *(_pm(p, "tokens_per_s_per_gpu", ",.0f") for p in row.points), f"{m:.4f} ± {s:.4f}",
                      f"{row.points[0].mean('transfer_s') * 1e3:.2f}", f"{row.points[0].mean('ttft_s') * 1e3:.1f}")
    return table


def print_report(results: Sequence[SweepResult], console: Console) -> None:
    for r in results:
        console.print(sweep_table(r))
    if len(results) > 1:
        console.print(comparison_table(results, results[0]))


def _point_json(p: PointSummary) -> dict[str, Any]:
    return {"load": p.load, "seeds": [r.seed for r in p.runs], "capacity_bound": p.capacity_bound,
            "mean": {m: p.mean(m) for m in METRICS}, "spread": {m: p.spread(m) for m in METRICS},
            "per_seed": {m: p.values(m) for m in ("tokens_per_s_per_gpu", "ttft_s", "itl_s")}}


def as_json(results: Sequence[SweepResult]) -> dict[str, Any]:
    """`points` is the first (default or baseline) variant's; `variants` holds every variant's."""
    variants = []
    for r in results:
        cfg = r.config
        desc, nbytes, blocks = cfg.typical()
        base = {p.load: p for p in results[0].points}
        ratios = {}
        for p in r.points:
            if p.load in base:
                m, s = paired_ratio(base[p.load], p)
                ratios[str(p.load)] = {"mean": m, "spread": s}
        variants.append({
            "name": r.name, "recipe": r.recipe, "scheme": r.scheme, "scheduling": cfg.scheduling.value,
            "arrivals": r.arrivals.value,
            "descriptors_per_request": desc, "transfer_bytes_per_request": nbytes,
            "transfer_s_alone": cfg.typical_transfer_s(),
            "decode_blocks_per_request": blocks, "decode_blocks_per_rank": cfg.decode.blocks_per_rank,
            "total_gpus": cfg.total_gpus, "cut_at": r.cut_at, "skipped": list(r.skipped),
            "ratio_to_first": ratios,
            "points": [_point_json(p) for p in r.points],
        })
    return {"points": variants[0]["points"] if variants else [], "variants": variants}


def sensitivity_json(rows: Sequence[SensitivityRow], schemes: Sequence[str]) -> dict[str, Any]:
    out = []
    for row in rows:
        m, s = paired_ratio(row.points[0], row.points[-1])
        out.append({"setting": row.setting.label, "knob": row.setting.knob, "factor": row.setting.factor,
                    "load": row.load, "gain": {"mean": m, "spread": s},
                    "schemes": {name: _point_json(p) for name, p in zip(schemes, row.points)}})
    return {"sensitivity": out, "schemes": list(schemes)}


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
        xs = [p.mean("tokens_per_s_per_user") for p in r.points]
        ys = [p.mean("tokens_per_s_per_gpu") for p in r.points]
        es = [p.spread("tokens_per_s_per_gpu") for p in r.points]
        dash, marker = styles[i % len(styles)]
        line = ax.errorbar(xs, ys, yerr=es, linestyle=dash, marker=marker, markersize=5, capsize=2,
                           label=r.name).lines[0]
        for p, x, y in zip(r.points, xs, ys):
            if p.capacity_bound:
                ax.plot([x], [y], marker="x", markersize=11, color=line.get_color())
        if r.points:
            for j in (0, len(r.points) - 1):
                ax.annotate(_load(r.arrivals, r.points[j].load), (xs[j], ys[j]), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=line.get_color())
    ax.set_xlabel("output tokens/s per user")
    ax.set_ylabel("total tokens/s per GPU (mean, bars: spread over seeds)")
    ax.set_title("Simulated disaggregated serving (x: decode cache full)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
