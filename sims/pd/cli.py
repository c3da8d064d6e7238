"""`hybridkv sim pd`: disaggregated-serving throughput from recipes, with Pareto plots."""

from __future__ import annotations

import argparse
import json
import sys


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Simulate prefill endpoints, KV/state transfers and decode endpoints over a closed-loop "
        "concurrency sweep; descriptor counts come from the descriptor analyzer.")
    parser.add_argument("--recipe", action="append", required=True, metavar="FILE",
                        help="recipe YAML (or the name of a shipped one, e.g. seed-6xdep2-1xdep8); "
                             "repeat for one curve per recipe")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--plot", metavar="OUT.png", help="write a Pareto plot (tokens/s/GPU vs tokens/s/user)")
    parser.add_argument("--compare-schemes", action="store_true",
                        help="run vllm-0.33 and hybridkv descriptor schemes, each with async scheduling "
                             "on and off")
    parser.add_argument("--concurrency", type=int, nargs="+", metavar="N",
                        help="override the recipe's sweep concurrencies")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.plot:
        # The plot comes last: a missing matplotlib must stop the run before minutes of simulation.
        import matplotlib  # noqa: F401
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .recipe import load_recipe
    from .report import as_json, plot_pareto, print_report
    from .sweep import run_variant, variants

    recipes = [load_recipe(p) for p in args.recipe]
    if args.concurrency:
        recipes = [r.with_sweep(tuple(args.concurrency)) for r in recipes]
    chosen = variants(recipes, compare_schemes=args.compare_schemes)
    # Tables go to stdout unless --json owns it; the progress bar always goes to stderr.
    err = Console(stderr=True)
    out = Console(stderr=args.json)
    if not out.is_terminal:
        # Piped or captured: do not squeeze the tables into 80 columns.
        out = Console(stderr=args.json, width=170)
    total = sum(len(v.recipe.sweep.concurrency) for v in chosen)
    results = []
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, transient=True) as progress:
            task = progress.add_task("simulating", total=total)
            for v in chosen:
                progress.update(task, description=f"{v.name}")
                done_before = progress.tasks[0].completed
                result = run_variant(v, on_point=lambda _p: progress.advance(task))
                # Points cut by the capacity limit still count as done for the bar.
                progress.update(task, completed=done_before + len(v.recipe.sweep.concurrency))
                results.append(result)
    except RuntimeError as exc:
        if "descriptor analyzer" not in str(exc):
            raise
        print(f"hybridkv: {exc}", file=sys.stderr)
        return 1
    if args.plot:
        path = plot_pareto(results, args.plot)
        err.print(f"wrote {path}")
    if args.json:
        print(json.dumps(as_json(results), indent=2))
    else:
        print_report(results, out)
    return 0
