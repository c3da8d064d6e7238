"""`hybridkv sim race`: corrupted requests per race class, with or without fencing."""

from __future__ import annotations

import argparse

from hybridkv.fencing.fence import FencePolicy

PROGRESS_FROM = 2000  # total simulated requests above which a progress bar is shown
# 1,000x the default: about an hour of simulation; more is a typo, not a measurement.
MAX_REQUESTS = 1_000_000


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Replay remote requests through an async-scheduled decode engine driving the real "
        "hybridkv scheduler, and count requests that computed on corrupted bytes, per race class."
    )
    from hybridkv.cli import bounded

    parser.add_argument("--policy", choices=[p.value for p in FencePolicy], default="fenced",
                        help="fence policy of the decode engine (none shows what breaks)")
    parser.add_argument("--requests", type=bounded(int, MAX_REQUESTS), default=1000, help="requests per race class")
    parser.add_argument("--seed", type=int, default=0, help="seed of the simulated workload")
    parser.add_argument(
        "--async-depth", type=int, default=1, help="steps the scheduler runs ahead of the device, 0 to 8"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hybridkv.cli import print_json
    from hybridkv.sims.race import RaceClass, simulate

    policy = FencePolicy(args.policy)
    if args.requests <= 0:
        raise ValueError(f"--requests {args.requests}; expected a positive number")
    if not 0 <= args.async_depth <= 8:
        raise ValueError(f"--async-depth {args.async_depth}; expected 0..8")
    results = []
    total = args.requests * len(RaceClass)
    show_progress = not args.json and total >= PROGRESS_FROM
    if show_progress:
        from rich.console import Console
        from rich.progress import Progress

        with Progress(console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task("simulating", total=total)
            for race in RaceClass:
                progress.update(task, description=race.value)
                results.append(
                    simulate(
                        race,
                        policy=policy,
                        requests=args.requests,
                        seed=args.seed,
                        async_depth=args.async_depth,
                        on_request_done=lambda: progress.advance(task),
                    )
                )
    else:
        for race in RaceClass:
            results.append(
                simulate(
                    race, policy=policy, requests=args.requests, seed=args.seed, async_depth=args.async_depth
                )
            )
    if args.json:
        doc = {
            "policy": policy.value,
            "async_depth": args.async_depth,
            "seed": args.seed,
            "races": {
                r.race.value: {
                    "requests": r.requests,
                    "corrupted": r.corrupted,
                    "corrupted_any_race": r.corrupted_any,
                    "aborted": r.aborted,
                    "steps": r.steps,
                    "causes": r.causes,
                }
                for r in results
            },
        }
        print_json(doc, indent=2)
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"async-scheduling races, policy {policy.value}, async depth {args.async_depth}, seed {args.seed}"
    )
    table.add_column("race class", no_wrap=True)
    table.add_column("requests", justify="right")
    table.add_column("corrupted", justify="right")
    table.add_column("any race", justify="right")
    table.add_column("aborted", justify="right")
    for r in results:
        style = "red" if r.corrupted_any else "green"
        table.add_row(
            r.race.value,
            str(r.requests),
            f"[{style}]{r.corrupted}[/]",
            f"[{style}]{r.corrupted_any}[/]",
            str(r.aborted),
        )
    console = Console()
    console.print(table)
    console.print(
        "corrupted: requests that computed on bytes their producer did not write, caused by the "
        "scenario's race; any race: by any race (unfenced, the other classes' ingredients - async "
        "frees above all - are present in every scenario). Causes per scenario: --json."
    )
    return 0
