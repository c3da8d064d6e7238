"""Tables, JSON and the Pareto plot of `hybridkv sim pd`: every figure as mean ± spread over seeds.

Comparisons claim only what the loop allows (sims/pd/sweep.py): closed loop, throughput at equal users;
open loop, capacity and TTFT at equal rate, never the throughput (it is the offered load). A ratio's
± is the seed spread, which is far below the model's own sensitivity (`--sensitivity` gives that range).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .params import METRICS, Arrivals
from .sweep import (PointSummary, SensitivityRow, SweepResult, gain_metric, paired_ratio_or_none,
                    sensitivity_range)


def _load(arrivals: Arrivals, load: float) -> str:
    return f"{load:,.0f}" if arrivals is Arrivals.CLOSED else f"{load:,.3g}/s"


def _pm(p: PointSummary, metric: str, fmt: str, scale: float = 1.0) -> str:
    return f"{format(p.mean(metric) * scale, fmt)} ± {format(p.spread(metric) * scale, fmt)}"


def sweep_table(result: SweepResult) -> Table:
    cfg = result.config
    desc, nbytes, blocks = cfg.typical()
    seeds = len(result.points[0].runs) if result.points else 0
    tp = cfg.decode.gpus_per_rank
    posted = (f" ({cfg.typical_posted():,} posted per thread, TP {cfg.prefill.gpus_per_rank}->{tp})"
              if cfg.typical_posted() != desc or tp > 1 or cfg.prefill.gpus_per_rank > 1 else "")
    title = (f"{result.name}: {desc:,} descriptors{posted}, {nbytes / 2**20:,.0f} MiB, "
             f"{cfg.typical_transfer_s() * 1e3:.2f} ms per transfer alone (mean lengths); {blocks} decode blocks of "
             f"{cfg.decode.blocks_per_rank:,} per rank; {cfg.total_gpus} GPUs; mean ± spread over {seeds} seeds")
    if result.arrivals is Arrivals.OPEN:
        title += "; open loop: tok/s/GPU is the offered load below capacity"
        if result.capacity is not None:
            how = "searched" if result.capacity.searched else "from the sweep"
            title += f"; capacity {result.capacity.describe()} ({how})"
    table = Table(title=title, title_justify="left")
    head = "users" if result.arrivals is Arrivals.CLOSED else "req/s"
    for col in (head, "tok/s/GPU", "out tok/s/GPU", "tok/s/user", "TTFT ms", "ITL ms", "xfer ms", "post ms",
                "xfer/TTFT", "preempt", "note"):
        table.add_column(col, justify="left" if col == "note" else "right")
    for p in result.points:
        notes = ["decode cache full: requests waited"] if p.capacity_bound else []
        if p.overloaded:
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
    """Closed loop: tok/s/GPU of every variant per load, with its ratio to `baseline` taken seed by seed.
    Open loop: TTFT at each rate where neither is overloaded, then each variant's capacity."""
    metric = gain_metric(baseline.arrivals)
    if baseline.arrivals is Arrivals.CLOSED:
        title = (f"tok/s/GPU (mean ± spread), ratio to {baseline.name} seed by seed (± is the seed spread; the "
                 "model's own sensitivity, --sensitivity, is wider). TTFT is not compared in a closed loop: a "
                 "faster decode refills the prefill queue")
        fmt, scale = ",.0f", 1.0
    else:
        title = (f"TTFT ms at equal rate (mean ± spread), ratio to {baseline.name} seed by seed, where neither "
                 "is overloaded; throughput is not compared (below capacity it is the offered load). Last row: "
                 "capacity, the highest rate without backlog growth")
        fmt, scale = ",.1f", 1e3
    table = Table(title=title, title_justify="left")
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
            if got.overloaded:
                row.append("overloaded")
                continue
            cell = _pm(got, metric, fmt, scale)
            if load in base and r is not baseline:
                ratio = paired_ratio_or_none(base[load], got, metric)
                cell += f" ({ratio[0]:.3f} ± {ratio[1]:.3f}x)" if ratio else " (baseline overloaded)"
            row.append(cell)
        table.add_row(*row)
    if baseline.arrivals is Arrivals.OPEN:
        row = ["capacity"]
        for r in results:
            cell = r.capacity.describe() if r.capacity else "-"
            cap = capacity_ratio(baseline, r)
            if cap is not None and r is not baseline:
                cell += f" ({cap:.3f}x)"
            row.append(cell)
        table.add_row(*row)
    return table


def capacity_ratio(baseline: SweepResult, other: SweepResult) -> float | None:
    """other's capacity over baseline's (each the highest rate without backlog growth), where both are bracketed."""
    a, b = baseline.capacity, other.capacity
    if a is None or b is None or a.rate is None or b.rate is None or a.above is None or b.above is None:
        return None
    return b.rate / a.rate


def sensitivity_table(rows: Sequence[SensitivityRow], schemes: Sequence[str], arrivals: Arrivals) -> Table:
    metric = gain_metric(arrivals)
    what = "tok/s/GPU" if arrivals is Arrivals.CLOSED else "TTFT at equal rate (below 1: faster)"
    table = Table(title=f"sensitivity: tok/s/GPU (mean ± spread over seeds); gain = {schemes[-1]} / {schemes[0]} "
                        f"of {what}, seed by seed; last rows: the gain's range per knob (with the recipe as given), the "
                        "model's sensitivity: quote it, not the seed spread", title_justify="left")
    for col in ("setting", "load", *schemes, "gain", f"xfer ms {schemes[0]}", f"TTFT ms {schemes[0]}"):
        table.add_column(col, justify="left" if col == "setting" else "right")
    for row in rows:
        ratio = paired_ratio_or_none(row.points[0], row.points[-1], metric)
        table.add_row(row.setting.label, _load(arrivals, row.load),
                      *(_pm(p, "tokens_per_s_per_gpu", ",.0f") for p in row.points),
                      f"{ratio[0]:.4f} ± {ratio[1]:.4f}" if ratio else "overloaded",
                      f"{row.points[0].mean('transfer_s') * 1e3:.2f}", f"{row.points[0].mean('ttft_s') * 1e3:.1f}")
    for (load, knob), (lo, hi) in sensitivity_range(rows).items():
        table.add_row(f"range: {knob}", _load(arrivals, load), *[""] * len(schemes), f"{lo:.4f}-{hi:.4f}", "", "")
    return table


def print_report(results: Sequence[SweepResult], console: Console) -> None:
    for r in results:
        console.print(sweep_table(r))
    if len(results) > 1:
        console.print(comparison_table(results, results[0]))


def _point_json(p: PointSummary) -> dict[str, Any]:
    return {"load": p.load, "seeds": [r.seed for r in p.runs], "capacity_bound": p.capacity_bound,
            "overloaded": p.overloaded,
            "mean": {m: p.mean(m) for m in METRICS}, "spread": {m: p.spread(m) for m in METRICS},
            "per_seed": {m: p.values(m) for m in ("tokens_per_s_per_gpu", "ttft_s", "itl_s")}}


def as_json(results: Sequence[SweepResult]) -> dict[str, Any]:
    """`points` is the first (default or baseline) variant's; `variants` holds every variant's.

    `ratio_to_first` is the comparison the loop allows, seed by seed: closed loop, tok/s/GPU at equal users;
    open loop, TTFT at equal rate (null where either side is overloaded), plus `capacity` and
    `capacity_ratio_to_first`. `ratio_metric` names which."""
    variants = []
    for r in results:
        cfg = r.config
        desc, nbytes, blocks = cfg.typical()
        base = {p.load: p for p in results[0].points}
        metric = gain_metric(r.arrivals)
        ratios: dict[str, Any] = {}
        for p in r.points:
            if p.load in base:
                got = paired_ratio_or_none(base[p.load], p, metric)
                ratios[str(p.load)] = {"mean": got[0], "spread": got[1]} if got else None
        cap = r.capacity
        variants.append({
            "name": r.name, "recipe": r.recipe, "scheme": r.scheme, "scheduling": cfg.scheduling.value,
            "arrivals": r.arrivals.value, "tp_prefill": cfg.prefill.gpus_per_rank, "tp_decode": cfg.decode.gpus_per_rank,
            "descriptors_per_request": desc, "descriptors_posted_per_thread": cfg.typical_posted(),
            "transfer_bytes_per_request": nbytes,
            "transfer_s_alone": cfg.typical_transfer_s(), "posting_on_step": cfg.posting.on_step,
            "decode_blocks_per_request": blocks, "decode_blocks_per_rank": cfg.decode.blocks_per_rank,
            "total_gpus": cfg.total_gpus, "cut_at": r.cut_at, "skipped": list(r.skipped),
            "ratio_metric": metric, "ratio_to_first": ratios,
            "capacity": None if cap is None else {"rate": cap.rate, "above": cap.above, "searched": cap.searched},
            "capacity_ratio_to_first": capacity_ratio(results[0], r) if r.arrivals is Arrivals.OPEN else None,
            "points": [_point_json(p) for p in r.points],
        })
    return {"points": variants[0]["points"] if variants else [], "variants": variants}


def sensitivity_json(rows: Sequence[SensitivityRow], schemes: Sequence[str]) -> dict[str, Any]:
    out = []
    metric = gain_metric(rows[0].points[0].runs[0].arrivals) if rows else "tokens_per_s_per_gpu"
    for row in rows:
        got = paired_ratio_or_none(row.points[0], row.points[-1], metric)
        out.append({"setting": row.setting.label, "knob": row.setting.knob, "factor": row.setting.factor,
                    "load": row.load, "gain": {"mean": got[0], "spread": got[1]} if got else None,
                    "schemes": {name: _point_json(p) for name, p in zip(schemes, row.points)}})
    ranges = [{"load": load, "knob": knob, "min": lo, "max": hi}
              for (load, knob), (lo, hi) in sensitivity_range(rows).items()]
    return {"sensitivity": out, "schemes": list(schemes), "gain_metric": metric, "gain_range": ranges}


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
