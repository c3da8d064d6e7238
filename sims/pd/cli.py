"""`hybridkv sim pd`: disaggregated-serving throughput from recipes, with Pareto plots."""

from __future__ import annotations

import argparse

from .params import MAX_CONCURRENCY, MAX_REQUEST_RATE, MAX_SEEDS, MAX_TP

MAX_KERNEL_BLOCK = 4096


def register(parser: argparse.ArgumentParser) -> None:
    from hybridkv.cli import bounded

    parser.description = (
        "Simulate prefill endpoints, KV/state transfers and decode endpoints over a load sweep "
        "(closed-loop users or open-loop request rates), several seeds per point; descriptor counts "
        "come from the descriptor analyzer.")
    parser.add_argument("--recipe", action="append", required=True, metavar="FILE",
                        help="recipe YAML (or the name of a shipped one, e.g. seed-6xdep2-1xdep8); "
                             "repeat for one curve per recipe (required)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    parser.add_argument("--plot", metavar="OUT.png",
                        help="write a Pareto plot (tokens/s/GPU vs tokens/s/user) (default: no plot)")
    parser.add_argument("--compare-schemes", metavar="A,B[,...]",
                        help="run each recipe once per descriptor scheme (the first is the baseline of the "
                             "ratios), e.g. vllm-0.33,hybridkv (default: the recipe's scheme only)")
    parser.add_argument("--sensitivity", action="store_true",
                        help="with --compare-schemes: move one cost at a time (posting and wire cost per "
                             "descriptor, bandwidth, async scheduling) and report each scheme and the gain")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=bounded(int, MAX_CONCURRENCY), nargs="+", metavar="N",
                      help="closed loop: these user counts instead of the recipe's sweep (default: the recipe's)")
    load.add_argument("--request-rate", type=bounded(float, MAX_REQUEST_RATE), nargs="+", metavar="R",
                      help="open loop: Poisson arrivals at these requests per second instead of the recipe's sweep "
                           "(default: the recipe's)")
    parser.add_argument("--capacity", action="store_true",
                        help="open loop: bisect each variant's capacity (the highest rate without backlog growth) "
                             "between the sweep's last rate without it and its first overloaded rate, to 2%%")
    parser.add_argument("--kernel-block-size", type=bounded(int, MAX_KERNEL_BLOCK), default=None, metavar="TOKENS",
                        help="the attention backend's kernel block, e.g. 16 for FlashInfer (vLLM 0.33 builds one id "
                             "per kernel block); overrides the recipe's model.kernel_block_size (default: the "
                             "recipe's, else the logical block)")
    parser.add_argument("--tp-prefill", type=bounded(int, MAX_TP), default=None, metavar="P",
                        help="attention TP of a prefill rank; overrides prefill.attention_tp, keeping every cost "
                             "per rank as the recipe gives it (default: the recipe's, else 1)")
    parser.add_argument("--tp-decode", type=bounded(int, MAX_TP), default=None, metavar="D",
                        help="attention TP of a decode rank; overrides decode.attention_tp, likewise (default: the "
                             "recipe's, else 1)")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--seeds", type=bounded(int, MAX_SEEDS), default=None, metavar="N",
                        help="seeds per point, S..S+N-1 (default: the recipe's sweep.seeds, else 3)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.plot:
        # The plot comes last: a missing matplotlib must stop the run before minutes of simulation.
        import matplotlib  # noqa: F401
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hybridkv.cli import CommandError, print_json

    from .params import Arrivals
    from .recipe import load_recipe
    from .report import as_json, plot_pareto, print_report, sensitivity_json, sensitivity_table
    from .sweep import parse_schemes, run_variant, sensitivity, settings, variants

    if args.seeds is not None and args.seeds < 1:
        raise ValueError(f"--seeds {args.seeds}: expected an integer >= 1")
    schemes = parse_schemes(args.compare_schemes) if args.compare_schemes else None
    if args.capacity and not args.request_rate:
        raise ValueError("--capacity searches an open loop's capacity: give --request-rate R... (one rate below "
                         "capacity and one above bracket it)")
    if args.sensitivity and (schemes is None or len(args.recipe) != 1 or args.plot):
        raise ValueError("--sensitivity needs --compare-schemes A,B[,...] and one --recipe (and no --plot)")
    recipes = [load_recipe(p) for p in args.recipe]
    for flag, value in (("--tp-prefill", args.tp_prefill), ("--tp-decode", args.tp_decode)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: expected an integer >= 1")
    if args.tp_prefill is not None or args.tp_decode is not None:
        recipes = [r.with_tp(args.tp_prefill, args.tp_decode) for r in recipes]
    if args.kernel_block_size is not None:
        recipes = [r.with_kernel_block_size(args.kernel_block_size) for r in recipes]
    if args.concurrency:
        recipes = [r.with_sweep(tuple(args.concurrency), arrivals=Arrivals.CLOSED) for r in recipes]
    elif args.request_rate:
        recipes = [r.with_sweep(tuple(args.request_rate), arrivals=Arrivals.OPEN) for r in recipes]
    if args.seeds is not None:
        recipes = [r.with_sweep(seeds=args.seeds) for r in recipes]
    # Resolve every configuration before simulating: a degenerate recipe fails in a second, as one line.
    chosen = variants(recipes, schemes=schemes)
    for v in chosen:
        v.recipe.sim_config(scheme=v.scheme, scheduling=v.scheduling)
    # Tables go to stdout unless --json owns it; the progress bar always goes to stderr.
    err = Console(stderr=True)
    out = Console(stderr=args.json)
    if not out.is_terminal:
        # Piped or captured: do not squeeze the tables into 80 columns.
        out = Console(stderr=args.json, width=200)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, transient=True) as progress:
            if args.sensitivity:
                recipe = recipes[0]
                total = len(settings(recipe)) * len(recipe.sweep.loads) * len(schemes)
                task = progress.add_task("sensitivity", total=total)
                rows = sensitivity(recipe, schemes, recipe.sweep.loads, seed=args.seed,
                                   on_point=lambda: progress.advance(task))
            else:
                total = sum(len(v.recipe.sweep.loads) for v in chosen)
                task = progress.add_task("simulating", total=total)
                results = []
                for v in chosen:
                    progress.update(task, description=f"{v.name}")
                    done_before = progress.tasks[0].completed
                    result = run_variant(v, seed=args.seed, search=args.capacity,
                                         on_point=lambda _p: progress.advance(task))
                    # Points cut by the capacity limit still count as done for the bar.
                    progress.update(task, completed=done_before + len(v.recipe.sweep.loads))
                    results.append(result)
    except RuntimeError as exc:
        if "descriptor analyzer" not in str(exc):
            raise
        raise CommandError(str(exc)) from exc
    if args.sensitivity:
        if args.json:
            print_json(sensitivity_json(rows, schemes), indent=2, allow_nan=False)
        else:
            out.print(sensitivity_table(rows, schemes, recipes[0].sweep.arrivals))
        return 0
    if args.plot:
        path = plot_pareto(results, args.plot)
        err.print(f"wrote {path}")
    if args.json:
        # allow_nan=False: a non-finite figure is a bug to see, never `Infinity` in the output.
        print_json(as_json(results), indent=2, allow_nan=False)
    else:
        print_report(results, out)
    return 0
