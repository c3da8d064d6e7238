"""Concurrency sweeps of one configuration, and the variants `--compare-schemes` runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .engine import simulate_point
from .params import PointResult, Scheduling, SimConfig
from .recipe import Recipe

# The two descriptor schemes the seed's ~7% claim is about: vLLM 0.33's NIXL connector
# and hybridkv's block-major layout.
COMPARE_SCHEMES = ("vllm-0.33", "hybridkv")


@dataclass(frozen=True, kw_only=True)
class SweepResult:
    name: str
    recipe: str
    scheme: str
    config: SimConfig
    points: tuple[PointResult, ...]
    # Concurrency values not run because an earlier point already ran out of decode cache.
    skipped: tuple[int, ...]

    @property
    def cut_at(self) -> int | None:
        """The first concurrency at which requests waited for decode cache, if any."""
        for p in self.points:
            if p.capacity_bound:
                return p.concurrency
        return None


def run_sweep(config: SimConfig, concurrency: Sequence[int], *, stop_at_capacity: bool,
              on_point: Callable[[PointResult], None] | None = None) -> tuple[tuple[PointResult, ...], tuple[int, ...]]:
    """Run each concurrency in order; with `stop_at_capacity`, stop after the first point
    whose requests had to wait for decode blocks (more users would only queue longer)."""
    points: list[PointResult] = []
    for i, c in enumerate(concurrency):
        point = simulate_point(config, c)
        points.append(point)
        if on_point is not None:
            on_point(point)
        if stop_at_capacity and point.capacity_bound:
            return tuple(points), tuple(concurrency[i + 1:])
    return tuple(points), ()


@dataclass(frozen=True, kw_only=True)
class Variant:
    recipe: Recipe
    scheme: str
    scheduling: Scheduling
    name: str


def variants(recipes: Sequence[Recipe], *, compare_schemes: bool) -> list[Variant]:
    """One variant per recipe, or per recipe x scheme x async on/off with the recipe's own
    setting first (it is the one reported under `points`)."""
    out: list[Variant] = []
    for recipe in recipes:
        prefix = f"{recipe.name} " if len(recipes) > 1 else ""
        if not compare_schemes:
            out.append(Variant(recipe=recipe, scheme=recipe.scheme, scheduling=recipe.scheduling,
                               name=recipe.name))
            continue
        combos = [(s, a) for s in COMPARE_SCHEMES for a in (Scheduling.SYNC, Scheduling.ASYNC)]
        own = (recipe.scheme, recipe.scheduling)
        combos = [own] + [c for c in combos if c != own]
        for scheme, sched in combos:
            label = "async" if sched is Scheduling.ASYNC else "sync"
            out.append(Variant(recipe=recipe, scheme=scheme, scheduling=sched,
                               name=f"{prefix}{scheme} {label}"))
    return out


def run_variant(variant: Variant, *, on_point: Callable[[PointResult], None] | None = None) -> SweepResult:
    recipe = variant.recipe
    config = recipe.sim_config(scheme=variant.scheme, scheduling=variant.scheduling)
    points, skipped = run_sweep(config, recipe.sweep.concurrency,
                                stop_at_capacity=recipe.sweep.stop_at_capacity, on_point=on_point)
    return SweepResult(name=variant.name, recipe=recipe.name, scheme=variant.scheme, config=config,
                       points=points, skipped=skipped)
