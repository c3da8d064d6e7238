"""`hybridkv bench fence`: per-step cost of fencing with 1,000 requests in flight.

One worker in both roles (vLLM's ``kv_both``) holds a steady mix of requests:
prefilling locally, exported and awaiting their consumer's read, importing
with transfers in flight, and decoding. Every engine step has the churn of a
busy server: decode requests finish and free their blocks, new imports
arrive (allocate, zero new attention blocks, post), transfers land and their
requests join, prefills finish and export, consumers read and release, a few
decode requests grow a block, and the worker reports the watermark with the
scheduler one step ahead (async depth 1).

Only the time spent inside the scheduler is measured, per step; the figure is
the median over the measured steps. Baselines measured in the same run:

* ``none``: the same scheduler and workload under ``FencePolicy.NONE`` - the
  bookkeeping without the rule checks and deferrals;
* ``per-block touch``: what a fence table *without* request residency would
  add: stamping the step on every block of every running request each step;
* ``no churn``: the fenced scheduler on a step where nothing arrives or
  finishes - the fixed per-step cost, independent of the batch size.

The headline ``median_us`` is the fenced scheduler under full churn.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

from hybridkv.fence import FencePolicy, PoolLayout
from hybridkv.request_state import attention_component, gdn_components
from hybridkv.scheduler import TransferScheduler

ATT, GDN = 0, 1
COMPONENTS = (attention_component(ATT), *gdn_components(GDN))

MIX = {"prefill": 100, "exporting": 150, "importing": 150, "decode": 600}
CHURN = 4  # decode finishes / import arrivals / landings per step
PREFILL_CHURN = 2  # prefill arrivals / finishes / export reads / releases per step
ATT_BLOCKS = (2, 8)  # attention blocks per request (hybrid block sizes are large)


@dataclass(frozen=True, kw_only=True)
class BenchResult:
    policy: FencePolicy
    median_us: float
    p90_us: float
    in_flight: int
    steps: int


def _run(
    policy: FencePolicy, *, steps: int, warmup: int, seed: int, touch_all: bool = False, churn: bool = True
) -> BenchResult:
    rng = random.Random(seed)
    in_flight_target = sum(MIX.values())
    sched = TransferScheduler(
        PoolLayout.shared(num_blocks=in_flight_target * 12, num_groups=2), policy=policy
    )
    pc = time.perf_counter_ns
    uid = 0
    prefill: list[str] = []
    exporting: list[str] = []
    importing: dict[str, int] = {}  # request -> transfer id
    decode: list[str] = []
    step = 0
    samples: list[int] = []

    def new_request(*, remote: bool) -> tuple[str, list[tuple[int, int]]]:
        nonlocal uid
        uid += 1
        rid = f"q{uid}"
        sched.add_request(rid, expect=COMPONENTS if remote else ())
        att = sched.allocate(rid, ATT, rng.randint(*ATT_BLOCKS))
        sched.allocate(rid, GDN, 1)
        return rid, [(ATT, b) for b in att]  # type: ignore[union-attr]

    # Fill to the mix, untimed.
    joined = []
    for _ in range(MIX["decode"] + MIX["prefill"] + MIX["exporting"]):
        joined.append(new_request(remote=False)[0])
    sched.step_scheduled(step, joined=joined)
    sched.step_completed(step)
    decode = joined[: MIX["decode"]]
    prefill = joined[MIX["decode"] : MIX["decode"] + MIX["prefill"]]
    for rid in joined[MIX["decode"] + MIX["prefill"] :]:
        sched.request_finished(rid, export=True)
        exporting.append(rid)
    for _ in range(MIX["importing"]):
        rid, _zero = new_request(remote=True)
        importing[rid] = sched.post_import(rid, components=COMPONENTS)  # type: ignore[assignment]
    reads: list[int] = []
    waiting: list[str] = []

    for i in range(warmup + steps):
        step += 1
        if not churn:
            t0 = pc()
            sched.step_scheduled(step)
            sched.step_completed(step - 1)
            sched.poll()
            t1 = pc()
            if i >= warmup:
                samples.append(t1 - t0)
            continue
        # Engine-side choices, made before the clock starts.
        finishing = [decode.pop(rng.randrange(len(decode))) for _ in range(CHURN)]
        landing = list(importing)[:CHURN]
        prefill_done = [prefill.pop(0) for _ in range(PREFILL_CHURN)]
        to_read = exporting[:PREFILL_CHURN]
        growing = rng.sample(decode, 2)

        t0 = pc()
        for rid in finishing:
            sched.request_finished(rid)
        ready = []
        for rid in landing:
            sched.transfer_landed(importing.pop(rid))
            if sched.is_ready(rid):
                ready.append(rid)
        zero: list[tuple[int, int]] = []
        fresh = []
        for _ in range(CHURN):
            rid, att = new_request(remote=True)
            zero.extend(att)
            fresh.append(rid)
        new_prefill = [new_request(remote=False)[0] for _ in range(PREFILL_CHURN)]
        for rid in growing:
            got = sched.allocate(rid, ATT, 1)
            zero.extend((ATT, b) for b in got)  # type: ignore[union-attr]
        for rid in prefill_done:
            sched.request_finished(rid, export=True)
        for rid in to_read:
            if sched.export_ready(rid):
                reads.append(sched.post_export(rid))  # type: ignore[arg-type]
        for tid in reads[:-PREFILL_CHURN] if len(reads) > PREFILL_CHURN else []:
            sched.transfer_landed(tid)
        ticket = sched.step_scheduled(step, joined=ready + new_prefill, zeroing=zero)
        waiting.extend(fresh)
        still = []
        for rid in waiting:  # the connector retries posts the fence said "not yet" to
            tid = sched.post_import(rid, components=COMPONENTS)
            if isinstance(tid, int):
                importing[rid] = tid
            else:
                still.append(rid)
        sched.step_completed(step - 1)
        sched.poll()
        if touch_all:
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
        if i >= warmup:
            samples.append(t1 - t0)
    in_flight = sched.requests_in_flight()
    samples.sort()
    return BenchResult(
        policy=policy,
        median_us=statistics.median(samples) / 1e3,
        p90_us=samples[int(0.9 * len(samples))] / 1e3,
        in_flight=in_flight,
        steps=len(samples),
    )


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = "Per-step overhead of the fence table and transfer scheduler, 1,000 requests in flight."
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(handler=run)


GOAL_US = 20.0


def run(args: argparse.Namespace) -> int:
    if args.steps < 10:
        raise ValueError(f"--steps {args.steps}; expected at least 10")
    warmup = max(50, args.steps // 10)
    fenced = _run(FencePolicy.FENCED, steps=args.steps, warmup=warmup, seed=args.seed)
    none = _run(FencePolicy.NONE, steps=args.steps, warmup=warmup, seed=args.seed)
    touch = _run(FencePolicy.FENCED, steps=args.steps, warmup=warmup, seed=args.seed, touch_all=True)
    quiet = _run(FencePolicy.FENCED, steps=args.steps, warmup=warmup, seed=args.seed, churn=False)
    if args.json:
        json.dump(
            {
                "median_us": round(fenced.median_us, 2),
                "p90_us": round(fenced.p90_us, 2),
                "in_flight": fenced.in_flight,
                "steps": fenced.steps,
                "goal_us": GOAL_US,
                "baselines": {
                    "none": {"median_us": round(none.median_us, 2), "in_flight": none.in_flight},
                    "per_block_touch": {"median_us": round(touch.median_us, 2), "in_flight": touch.in_flight},
                    "fenced_no_churn": {"median_us": round(quiet.median_us, 2), "in_flight": quiet.in_flight},
                },
                "mix": MIX,
            },
            sys.stdout,
            indent=2,
        )
        sys.stdout.write("\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fence + scheduler cost per engine step ({fenced.steps} steps, same run)")
    table.add_column("variant")
    table.add_column("in flight", justify="right")
    table.add_column("median us/step", justify="right")
    table.add_column("p90 us/step", justify="right")
    table.add_column("vs fenced", justify="right")
    for label, r in (
        ("fenced (hybridkv)", fenced),
        ("none: bookkeeping, rules off", none),
        ("fenced + per-block touch (no residency)", touch),
        ("fenced, step with no arrivals/finishes", quiet),
    ):
        table.add_row(
            label, str(r.in_flight), f"{r.median_us:.1f}", f"{r.p90_us:.1f}", f"{r.median_us / fenced.median_us:.2f}x"
        )
    console = Console()
    console.print(table)
    verdict = "meets" if fenced.median_us <= GOAL_US else "misses"
    console.print(f"median {fenced.median_us:.1f} us per step {verdict} the {GOAL_US:.0f} us goal. Mix per step: {MIX}")
    return 0
