"""Load sweeps of one configuration over several seeds, the variants `--compare-schemes` runs,
open-loop capacity (the highest rate without backlog growth), and the sensitivity table (posting
cost, wire cost, bandwidth, async on/off).

What a comparison may claim depends on the loop. Closed loop: throughput at equal users (TTFT is
confounded: a faster decode sends the next request sooner and refills the prefill queue). Open loop:
throughput is the offered load below capacity, so schemes compare by capacity and by TTFT at equal
rate, where neither is overloaded.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .engine import simulate_point
from .params import Arrivals, PointResult, Scheduling, SimConfig
from .recipe import Recipe


@dataclass(frozen=True, kw_only=True)
class PointSummary:
    """One load, run once per seed: every figure is reported as the mean and the spread
    (sample standard deviation) over the seeds."""

    load: float
    runs: tuple[PointResult, ...]

    def values(self, metric: str) -> list[float]:
        return [r.value(metric) for r in self.runs]

    def mean(self, metric: str) -> float:
        return statistics.fmean(self.values(metric))

    def spread(self, metric: str) -> float:
        vals = self.values(metric)
        return statistics.stdev(vals) if len(vals) > 1 else 0.0

    @property
    def capacity_bound(self) -> bool:
        return any(r.capacity_bound for r in self.runs)

    @property
    def overloaded(self) -> bool:
        """Open loop only: the queue grew in the window by more than OVERLOAD_SHARE of the requests the
        window completed (below capacity it only wanders by Poisson noise, a few percent at most)."""
        return (bool(self.runs) and self.runs[0].arrivals is Arrivals.OPEN
                and self.mean("backlog_growth") > OVERLOAD_SHARE * self.mean("completed"))


# The backlog growth, as a share of a window's completions, past which an open-loop point is overloaded.
# Past capacity the queue grows by (rate / capacity - 1) of the completions, so a point is flagged from
# ~5% above its capacity: the capacity found is high by up to that much, for every scheme alike.
OVERLOAD_SHARE = 0.05


def paired_ratio(a: PointSummary, b: PointSummary, metric: str = "tokens_per_s_per_gpu") -> tuple[float, float]:
    """Mean and spread over seeds of b / a, seed by seed: the same seed draws the same requests and
    arrivals for both, so the ratio's spread is the comparison's own noise."""
    ra = {r.seed: r.value(metric) for r in a.runs}
    ratios = [r.value(metric) / ra[r.seed] for r in b.runs if r.seed in ra and ra[r.seed] > 0]
    if not ratios:
        raise ValueError("no common seed to compare")
    return statistics.fmean(ratios), (statistics.stdev(ratios) if len(ratios) > 1 else 0.0)


@dataclass(frozen=True, kw_only=True)
class SweepResult:
    name: str
    recipe: str
    scheme: str
    config: SimConfig
    arrivals: Arrivals
    points: tuple[PointSummary, ...]
    # Loads not run because an earlier point already ran out of decode cache.
    skipped: tuple[float, ...]
    # Open loop only: where the capacity lies (from the sweep, or searched).
    capacity: Capacity | None = None

    @property
    def cut_at(self) -> float | None:
        """The first load at which requests waited for decode cache, if any."""
        for p in self.points:
            if p.capacity_bound:
                return p.load
        return None


def paired_ratio_or_none(a: PointSummary, b: PointSummary, metric: str) -> tuple[float, float] | None:
    """`paired_ratio`, or None where the comparison means nothing: an open-loop point either side overloaded
    (its TTFT then grows with the run's length)."""
    if a.overloaded or b.overloaded:
        return None
    return paired_ratio(a, b, metric)


def run_point(config: SimConfig, load: float, *, arrivals: Arrivals, seeds: Sequence[int]) -> PointSummary:
    return PointSummary(load=load, runs=tuple(simulate_point(config, load, arrivals=arrivals, seed=s)
                                              for s in seeds))


def run_sweep(config: SimConfig, loads: Sequence[float], *, arrivals: Arrivals = Arrivals.CLOSED,
              seeds: Sequence[int] = (0,), stop_at_capacity: bool,
              on_point: Callable[[PointSummary], None] | None = None,
              ) -> tuple[tuple[PointSummary, ...], tuple[float, ...]]:
    """Run each load in order; with `stop_at_capacity`, stop after the first point where a
    request had to wait for decode blocks (more load would only queue longer)."""
    points: list[PointSummary] = []
    for i, load in enumerate(loads):
        point = run_point(config, load, arrivals=arrivals, seeds=seeds)
        points.append(point)
        if on_point is not None:
            on_point(point)
        if stop_at_capacity and point.capacity_bound:
            return tuple(points), tuple(loads[i + 1:])
    return tuple(points), ()


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """Open-loop capacity: the highest rate run without backlog growth (`rate`; None: every rate run was
    overloaded) and the lowest overloaded one above it (`above`; None: none was), so it lies in
    [rate, above). `searched`: bisected between the sweep's two to `CAPACITY_TOLERANCE`."""

    rate: float | None
    above: float | None
    searched: bool = False

    def describe(self) -> str:
        if self.rate is None:
            return f"< {self.above:,.3g}/s"
        if self.above is None:
            return f">= {self.rate:,.3g}/s"
        return f"{self.rate:,.3g}-{self.above:,.3g}/s"


# Bisection stops when the overloaded rate is within this factor of the last rate without backlog growth.
CAPACITY_TOLERANCE = 0.02


def sweep_capacity(points: Sequence[PointSummary]) -> Capacity:
    """The bracket a swept open loop gives: the rate below its first overloaded point, and that point."""
    rate = None
    for p in points:
        if p.overloaded:
            return Capacity(rate=rate, above=p.load)
        rate = p.load
    return Capacity(rate=rate, above=None)


def search_capacity(config: SimConfig, bracket: Capacity, *, seeds: Sequence[int], max_steps: int = 12,
                    on_point: Callable[[], None] | None = None) -> Capacity:
    """Bisect (geometrically) between the bracket's rates until they are within CAPACITY_TOLERANCE."""
    if bracket.rate is None or bracket.above is None:
        return bracket
    lo, hi = bracket.rate, bracket.above
    for _ in range(max_steps):
        if hi <= lo * (1 + CAPACITY_TOLERANCE):
            break
        mid = (lo * hi) ** 0.5
        point = run_point(config, mid, arrivals=Arrivals.OPEN, seeds=seeds)
        if on_point is not None:
            on_point()
        if point.overloaded:
            hi = mid
        else:
            lo = mid
    return Capacity(rate=lo, above=hi, searched=True)


@dataclass(frozen=True, kw_only=True)
class Variant:
    recipe: Recipe
    scheme: str
    scheduling: Scheduling
    name: str


def parse_schemes(text: str) -> tuple[str, ...]:
    """`--compare-schemes A,B[,...]`: two or more known schemes, the first being the baseline."""
    from .model import check_scheme

    names = tuple(p.strip() for p in text.split(","))
    if len(names) < 2 or any(not n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"--compare-schemes {text!r}: expected two or more different schemes, A,B[,...]")
    for n in names:
        check_scheme(n)
    return names


def variants(recipes: Sequence[Recipe], *, schemes: Sequence[str] | None = None) -> list[Variant]:
    """One variant per recipe, or per recipe x scheme (the first scheme is the baseline), each
    with the recipe's own scheduling."""
    out: list[Variant] = []
    for recipe in recipes:
        prefix = f"{recipe.name} " if len(recipes) > 1 else ""
        if not schemes:
            out.append(Variant(recipe=recipe, scheme=recipe.scheme, scheduling=recipe.scheduling, name=recipe.name))
            continue
        for scheme in schemes:
            out.append(Variant(recipe=recipe, scheme=scheme, scheduling=recipe.scheduling,
                               name=f"{prefix}{scheme}"))
    return out


def seeds_of(recipe: Recipe, base: int) -> tuple[int, ...]:
    return tuple(range(base, base + recipe.sweep.seeds))


def run_variant(variant: Variant, *, seed: int = 0, search: bool = False,
                on_point: Callable[[PointSummary], None] | None = None,
                on_search: Callable[[], None] | None = None) -> SweepResult:
    """One variant's sweep; in open loop also its capacity (bisected between the sweep's rates if `search`).
    An open loop runs every rate: a point past capacity is what brackets it."""
    recipe = variant.recipe
    config = recipe.sim_config(scheme=variant.scheme, scheduling=variant.scheduling)
    arrivals = recipe.sweep.arrivals
    seeds = seeds_of(recipe, seed)
    points, skipped = run_sweep(config, recipe.sweep.loads, arrivals=arrivals, seeds=seeds,
                                stop_at_capacity=recipe.sweep.stop_at_capacity and arrivals is Arrivals.CLOSED,
                                on_point=on_point)
    capacity = None
    if arrivals is Arrivals.OPEN:
        capacity = sweep_capacity(points)
        if search:
            capacity = search_capacity(config, capacity, seeds=seeds, on_point=on_search)
    return SweepResult(name=variant.name, recipe=recipe.name, scheme=variant.scheme, config=config,
                       arrivals=arrivals, points=points, skipped=skipped, capacity=capacity)


# --- sensitivity ------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Setting:
    label: str
    # Which knob moved, for the reader: "posting", "wire", "bandwidth", "scheduling" or "" (as given).
    knob: str
    factor: float
    recipe: Recipe


def settings(recipe: Recipe) -> list[Setting]:
    """The recipe as given, then one knob moved at a time."""
    out = [Setting(label="as given", knob="", factor=1.0, recipe=recipe)]
    for f in (0.0, 0.5, 2.0, 4.0):
        out.append(Setting(label=f"posting per descriptor x{f:g}", knob="posting", factor=f, recipe=replace(
            recipe, posting=replace(recipe.posting, per_descriptor_s=recipe.posting.per_descriptor_s * f))))
    for f in (0.0, 2.0, 4.0):
        out.append(Setting(label=f"wire per descriptor x{f:g}", knob="wire", factor=f, recipe=replace(
            recipe, link=replace(recipe.link, per_descriptor_s=recipe.link.per_descriptor_s * f))))
    for f in (0.25, 0.5, 2.0, 10.0):
        out.append(Setting(label=f"bandwidth x{f:g}", knob="bandwidth", factor=f, recipe=replace(
            recipe, link=replace(recipe.link, bytes_per_s=recipe.link.bytes_per_s * f))))
    flipped = Scheduling.SYNC if recipe.scheduling is Scheduling.ASYNC else Scheduling.ASYNC
    out.append(Setting(label=f"scheduling {flipped.value}", knob="scheduling", factor=1.0,
                       recipe=replace(recipe, scheduling=flipped)))
    return out


@dataclass(frozen=True, kw_only=True)
class SensitivityRow:
    setting: Setting
    load: float
    # One summary per scheme, in the order compared.
    points: tuple[PointSummary, ...]


def gain_metric(arrivals: Arrivals) -> str:
    """What a scheme's gain is read from: throughput at equal users (closed loop), TTFT at equal rate (open
    loop, where throughput is the offered load)."""
    return "tokens_per_s_per_gpu" if arrivals is Arrivals.CLOSED else "ttft_s"


def sensitivity_range(rows: Sequence[SensitivityRow]) -> dict[tuple[float, str], tuple[float, float]]:
    """Per load and knob, the lowest and highest gain (last scheme over the first, seed by seed) over that knob's
    settings and the recipe as given: how far the model's own inputs move the answer, the uncertainty to quote
    (the seed spread is far smaller). Knobs a comparison does not favour (wire cost, bandwidth) give the
    model's structural noise; the posting knob, how much of the gain is the posting cost."""
    given: dict[float, float] = {}
    out: dict[tuple[float, str], list[float]] = {}
    for row in rows:
        got = paired_ratio_or_none(row.points[0], row.points[-1], gain_metric(row.points[0].runs[0].arrivals))
        if got is None:
            continue
        if not row.setting.knob:
            given[row.load] = got[0]
        else:
            out.setdefault((row.load, row.setting.knob), []).append(got[0])
    spans = {}
    for (load, knob), gains in out.items():
        gains = gains + ([given[load]] if load in given else [])
        spans[(load, knob)] = (min(gains), max(gains))
    return spans


def sensitivity(recipe: Recipe, schemes: Sequence[str], loads: Sequence[float], *, seed: int = 0,
                on_point: Callable[[], None] | None = None) -> list[SensitivityRow]:
    rows = []
    seeds = seeds_of(recipe, seed)
    for s in settings(recipe):
        configs = [s.recipe.sim_config(scheme=scheme) for scheme in schemes]
        for load in loads:
            pts = []
            for cfg in configs:
                pts.append(run_point(cfg, load, arrivals=recipe.sweep.arrivals, seeds=seeds))
                if on_point is not None:
                    on_point()
            rows.append(SensitivityRow(setting=s, load=load, points=tuple(pts)))
    return rows
