"""`hybridkv bench fence`: per-step cost of fencing with 1,000 requests in flight.

One worker in both roles (vLLM's ``kv_both``) holds a steady mix of requests:
prefilling locally, exported and awaiting their consumer's read, importing
with transfers in flight, and decoding. Every engine step has the churn of a
busy server: decode requests finish and free their blocks, new imports
arrive (allocate, zero new attention blocks, post), transfers land and their
requests join, prefills finish and export, consumers read and release, a few
decode requests grow a block, and the worker reports the watermark with the
scheduler one step ahead (async depth 1).

Only the time spent inside the scheduler is measured, per step (the engine's
own choices - which requests finish, request ids and sizes - are drawn before
the clock starts); the figure is the median over the measured steps.

The engine makes the calls a connector makes: one per request and transfer
(``add_request`` and ``allocate`` per group, ``request_finished``,
``transfer_landed``, ``post_import`` retried until the fence allows it, ...).

Baselines measured in the same run:

* ``none``: the same scheduler and workload under ``FencePolicy.NONE`` - the
  bookkeeping without the rule checks and deferrals;
* ``per-block touch``: what a fence table *without* request residency would
  add: stamping the step on every block of every running request each step;
* ``no churn``: the fenced scheduler on a step where nothing arrives or
  finishes - the fixed per-step cost, independent of the batch size.

Every variant is its own worker; they take turns of a few dozen steps (who goes
first rotates), so load from other processes on a shared machine falls on all
of them alike and the ratios stay meaningful when the absolute figures move.

The headline ``median_us`` is the fenced scheduler under full churn.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

from hybridkv.fencing.fence import FencePolicy, NotYet, PoolLayout
from hybridkv.fencing.request_state import attention_component, gdn_components
from hybridkv.fencing.scheduler import TransferScheduler

ATT, GDN = 0, 1
COMPONENTS = (attention_component(ATT), *gdn_components(GDN))

MIX = {"prefill": 100, "exporting": 150, "importing": 150, "decode": 600}
CHURN = 4  # decode finishes / import arrivals / landings per step
PREFILL_CHURN = 2  # prefill arrivals / finishes / export reads / releases per step
ATT_BLOCKS = (2, 8)  # attention blocks per request (hybrid block sizes are large)
GOAL_US = 20.0
# Steps a variant runs before the next one's turn: short enough that every
# variant sees the same load from other processes, long enough that each runs
# with its own data in the caches, as a scheduler does between engine steps.
CHUNK = 50
# A step costs ~20 us per variant, four variants: a million steps is minutes.
MAX_STEPS = 1_000_000


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One simulated worker: the policy and how it calls the scheduler."""

    label: str
    policy: FencePolicy
    touch_all: bool = False
    churn: bool = True


VARIANTS = {
    "fenced": Variant(label="fenced (hybridkv)", policy=FencePolicy.FENCED),
    "none": Variant(label="none: bookkeeping, rules off", policy=FencePolicy.NONE),
    "per_block_touch": Variant(
        label="fenced + per-block touch (no residency)", policy=FencePolicy.FENCED, touch_all=True
    ),
    "fenced_no_churn": Variant(
        label="fenced, step with no arrivals/finishes", policy=FencePolicy.FENCED, churn=False
    ),
}


@dataclass(frozen=True, kw_only=True)
class BenchResult:
    policy: FencePolicy
    median_us: float
    p90_us: float
    in_flight: int
    steps: int


def _worker(v: Variant, *, seed: int) -> Iterator[tuple[int, int]]:
    """A worker under the bench's workload; each ``next`` runs one engine step and
    yields (nanoseconds spent inside the scheduler, requests in flight)."""
    rng = random.Random(seed)
    in_flight_target = sum(MIX.values())
    sched = TransferScheduler(
        PoolLayout.shared(num_blocks=in_flight_target * 12, num_groups=2), policy=v.policy
    )
    pc = time.perf_counter_ns
    uid = 0
    importing: dict[str, int] = {}  # request -> transfer id
    step = 0

    def arrival() -> tuple[str, int]:
        """The engine's side of an arrival: its id and attention blocks."""
        nonlocal uid
        uid += 1
        return f"q{uid}", rng.randint(*ATT_BLOCKS)

    def new_request(rid: str, n: int, *, remote: bool) -> list[tuple[int, int]]:
        sched.add_request(rid, expect=COMPONENTS if remote else ())
        att = sched.allocate(rid, ATT, n)
        sched.allocate(rid, GDN, 1)
        return [(ATT, b) for b in att]  # type: ignore[union-attr]

    # Fill to the mix, untimed.
    joined = []
    for _ in range(MIX["decode"] + MIX["prefill"] + MIX["exporting"]):
        rid, n = arrival()
        new_request(rid, n, remote=False)
        joined.append(rid)
    sched.step_scheduled(step, joined=joined)
    sched.step_completed(step)
    decode = joined[: MIX["decode"]]
    prefill = joined[MIX["decode"] : MIX["decode"] + MIX["prefill"]]
    exporting = joined[MIX["decode"] + MIX["prefill"] :]
    for rid in exporting:
        sched.request_finished(rid, export=True)
    for _ in range(MIX["importing"]):
        rid, n = arrival()
        new_request(rid, n, remote=True)
        importing[rid] = sched.post_import(rid, components=COMPONENTS)  # type: ignore[assignment]
    reads: list[int] = []
    waiting: list[str] = []

    while True:
        step += 1
        if not v.churn:
            t0 = pc()
            sched.step_scheduled(step)
            sched.step_completed(step - 1)
            sched.poll()
            t1 = pc()
            yield t1 - t0, sched.requests_in_flight()
            continue
        # Engine-side choices, made before the clock starts.
        finishing = [decode.pop(rng.randrange(len(decode))) for _ in range(CHURN)]
        landing = list(importing)[:CHURN]
        prefill_done = [prefill.pop(0) for _ in range(PREFILL_CHURN)]
        to_read = exporting[:PREFILL_CHURN]
        growing = rng.sample(decode, 2)
        fresh_arrivals = [arrival() for _ in range(CHURN)]
        prefill_arrivals = [arrival() for _ in range(PREFILL_CHURN)]
        fresh = [rid for rid, _ in fresh_arrivals]
        new_prefill = [rid for rid, _ in prefill_arrivals]
        landing_tids = [importing.pop(rid) for rid in landing]

        t0 = pc()
        for rid in finishing:
            sched.request_finished(rid)
        for tid in landing_tids:
            sched.transfer_landed(tid)
        ready = [rid for rid in landing if sched.is_ready(rid)]
        zero: list[tuple[int, int]] = []
        for rid, n in fresh_arrivals:
            zero += new_request(rid, n, remote=True)
        for rid, n in prefill_arrivals:
            new_request(rid, n, remote=False)
        for rid in growing:
            got = sched.allocate(rid, ATT, 1)
            zero.extend((ATT, b) for b in got)  # type: ignore[union-attr]
        for rid in prefill_done:
            sched.request_finished(rid, export=True)
        for rid in to_read:
            if not isinstance(sched.export_ready(rid), NotYet):
                reads.append(sched.post_export(rid))  # type: ignore[arg-type]
        landed_reads = reads[:-PREFILL_CHURN] if len(reads) > PREFILL_CHURN else []  # consumers' reads end
        for tid in landed_reads:
            sched.transfer_landed(tid)
        ticket = sched.step_scheduled(step, joined=ready + new_prefill, zeroing=zero)
        waiting.extend(fresh)
        still = []
        for rid in waiting:  # the connector retries posts the fence said "not yet" to
            tid = sched.post_import(rid, components=COMPONENTS)
            if isinstance(tid, NotYet):
                still.append(rid)
            else:
                importing[rid] = tid
        sched.step_completed(step - 1)
        sched.poll()
        if v.touch_all:
            # Baseline: a fence without residency stamps every running block each step.
            fence = sched.table.fence
            for rid in decode:
                for keys in sched._requests[rid].blocks.values():  # noqa: SLF001 - baseline only
                    for k in keys:
                        fence[k] = step
        t1 = pc()

        # Bookkeeping of the simulated engine, untimed.
        del ticket
        if len(reads) > PREFILL_CHURN:
            reads = reads[-PREFILL_CHURN:]
            for rid in exporting[:PREFILL_CHURN]:
                sched.export_done(rid)
            exporting = exporting[PREFILL_CHURN:]
        exporting.extend(prefill_done)
        prefill.extend(new_prefill)
        decode.extend(ready)
        waiting = still
        yield t1 - t0, sched.requests_in_flight()


def measure(names: list[str], *, steps: int, warmup: int, seed: int) -> dict[str, BenchResult]:
    """Run the named variants (keys of VARIANTS) CHUNK steps each in turn; the
    first ``warmup`` steps of each are not counted."""
    workers = [(name, _worker(VARIANTS[name], seed=seed)) for name in names]
    samples: dict[str, list[int]] = {name: [] for name in names}
    in_flight = dict.fromkeys(names, 0)
    done = 0
    for r in range(-(-(warmup + steps) // CHUNK)):
        n = min(CHUNK, warmup + steps - done)
        first = r % len(workers)
        for name, w in workers[first:] + workers[:first]:
            for i in range(done, done + n):
                ns, in_flight[name] = next(w)
                if i >= warmup:
                    samples[name].append(ns)
        done += n
    out = {}
    for name in names:
        s = sorted(samples[name])
        out[name] = BenchResult(
            policy=VARIANTS[name].policy,
            median_us=statistics.median(s) / 1e3,
            p90_us=s[int(0.9 * len(s))] / 1e3,
            in_flight=in_flight[name],
            steps=len(s),
        )
    return out


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = "Per-step overhead of the fence table and transfer scheduler, 1,000 requests in flight."
    from hybridkv.cli import bounded

    parser.add_argument("--steps", type=bounded(int, MAX_STEPS), default=3000,
                        help="engine steps each variant runs (at least 10; the first tenth, at least 50, warm up)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the engine's choices")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hybridkv.cli import print_json

    if args.steps < 10:
        raise ValueError(f"--steps {args.steps}; expected at least 10")
    warmup = max(50, args.steps // 10)
    r = measure(list(VARIANTS), steps=args.steps, warmup=warmup, seed=args.seed)
    fenced = r["fenced"]
    if args.json:
        print_json(
            {
                "median_us": round(fenced.median_us, 2),
                "p90_us": round(fenced.p90_us, 2),
                "in_flight": fenced.in_flight,
                "steps": fenced.steps,
                "goal_us": GOAL_US,
                "baselines": {
                    name: {"median_us": round(r[name].median_us, 2), "in_flight": r[name].in_flight}
                    for name in ("none", "per_block_touch", "fenced_no_churn")
                },
                "mix": MIX,
            },
            indent=2,
        )
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fence + scheduler cost per engine step ({fenced.steps} steps, same run, variants in turns)")
    table.add_column("variant")
    table.add_column("in flight", justify="right")
    table.add_column("median us/step", justify="right")
    table.add_column("p90 us/step", justify="right")
    table.add_column("vs fenced", justify="right")
    for name, v in VARIANTS.items():
        x = r[name]
        table.add_row(
            v.label, str(x.in_flight), f"{x.median_us:.1f}", f"{x.p90_us:.1f}", f"{x.median_us / fenced.median_us:.2f}x"
        )
    console = Console()
    console.print(table)
    verdict = "meets" if fenced.median_us <= GOAL_US else "misses"
    console.print(f"median {fenced.median_us:.1f} us per step {verdict} the {GOAL_US:.0f} us goal. Mix per step: {MIX}")
    return 0
