"""YAML recipes for `hybridkv sim pd`: read strictly, every parameter with its source.

A recipe names a model preset, a descriptor scheme, topology, cost figures, a workload
and a sweep. `sources:` maps each parameter's dotted path to where its value comes from,
written "cited: ...", "measured: ...", "derived: ..." or "assumed: ..."; a parameter
without a source is an error, so a recipe cannot quietly carry an unexplained number.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from .params import (DecodeSpec, LinkSpec, PrefillSpec, RequestSpec, Scheduling, SimConfig,
                        StepCost)

SOURCE_KINDS = ("cited", "measured", "derived", "assumed")
RECIPE_DIR = Path(__file__).parent.parent / "recipes"
_COST_KEYS = ("cpu_base_s", "cpu_per_request_s", "device_base_s", "device_per_request_s",
              "device_per_token_s", "device_per_context_token_s")


class _Reader:
    """Walks a mapping, records every leaf it reads, and rejects keys nobody read."""

    def __init__(self, data: Any, path: str, leaves: list[str]) -> None:
        if not isinstance(data, dict):
            raise ValueError(f"recipe section {path or '<top>'!r}: expected a mapping, got {type(data).__name__}")
        self.data = data
        self.path = path
        self.leaves = leaves
        self.read: set[str] = set()

    def _key(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def section(self, key: str) -> _Reader:
        self.read.add(key)
        if key not in self.data:
            raise ValueError(f"recipe is missing section {self._key(key)!r}")
        return _Reader(self.data[key], self._key(key), self.leaves)

    def raw(self, key: str, default: Any = ..., *, leaf: bool = True) -> Any:
        self.read.add(key)
        if key not in self.data:
            if default is ...:
                raise ValueError(f"recipe is missing {self._key(key)!r}")
            return default
        if leaf:
            self.leaves.append(self._key(key))
        return self.data[key]

    def number(self, key: str, default: Any = ...) -> float:
        value = self.raw(key, default)
        # YAML 1.1 reads 40e9 (no dot, no exponent sign) as a string.
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"{self._key(key)}={value!r}: expected a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{self._key(key)}={value!r}: expected a number")
        return float(value)

    def integer(self, key: str, default: Any = ...) -> int:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{self._key(key)}={value!r}: expected an integer")
        return value

    def optional_int(self, key: str) -> int | None:
        value = self.raw(key, None)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{self._key(key)}={value!r}: expected an integer or null")
        return value

    def text(self, key: str, default: Any = ...) -> str | None:
        value = self.raw(key, default)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{self._key(key)}={value!r}: expected a string")
        return value

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.read)
        if unknown:
            raise ValueError(f"recipe section {self.path or '<top>'!r} has unknown keys: {', '.join(unknown)}")


def _cost(reader: _Reader) -> StepCost:
    cost = StepCost(**{k: reader.number(k, 0.0) for k in _COST_KEYS})
    reader.done()
    return cost


@dataclass(frozen=True, kw_only=True)
class Sweep:
    concurrency: tuple[int, ...]
    stop_at_capacity: bool
    warmup_requests: int | None
    measure_requests: int | None


@dataclass(frozen=True, kw_only=True)
class Recipe:
    name: str
    path: Path
    preset: str
    ssm_dtype: str | None
    block_size: int | None
    isl: int
    osl: int
    prefill: PrefillSpec
    decode_endpoints: int
    decode_ranks: int
    cache_bytes_per_rank: float
    decode_cost: StepCost
    scheme: str
    fragmentation: float
    per_descriptor_s: float
    bytes_per_s: float
    latency_s: float
    posting_on_step: bool
    scheduling: Scheduling
    sweep: Sweep
    sources: dict[str, str]

    def with_sweep(self, concurrency: tuple[int, ...], *, warmup_requests: int | None = None,
                   measure_requests: int | None = None) -> Recipe:
        """The same recipe over fewer points or a shorter window (CI's reduced sweep)."""
        sweep = replace(self.sweep, concurrency=_concurrencies(list(concurrency)),
                        warmup_requests=warmup_requests if warmup_requests is not None else self.sweep.warmup_requests,
                        measure_requests=measure_requests if measure_requests is not None else self.sweep.measure_requests)
        return replace(self, sweep=sweep)

    def sim_config(self, *, scheme: str | None = None, scheduling: Scheduling | None = None) -> SimConfig:
        """Resolve the model and the analyzer's descriptor count into plain numbers."""
        from .model import decode_memory, model_geometry, request_transfer

        geometry = model_geometry(self.preset, self.ssm_dtype)
        transfer = request_transfer(scheme or self.scheme, geometry, tokens=self.isl,
                                    block_size=self.block_size, fragmentation=self.fragmentation)
        memory = decode_memory(geometry, tokens=self.isl + self.osl,
                               cache_bytes_per_rank=self.cache_bytes_per_rank, block_size=self.block_size)
        return SimConfig(
            prefill=self.prefill,
            decode=DecodeSpec(endpoints=self.decode_endpoints, ranks=self.decode_ranks,
                              blocks_per_rank=memory.blocks_per_rank, cost=self.decode_cost),
            link=LinkSpec(per_descriptor_s=self.per_descriptor_s, bytes_per_s=self.bytes_per_s,
                          latency_s=self.latency_s, posting_on_step=self.posting_on_step),
            request=RequestSpec(isl=self.isl, osl=self.osl, transfer_descriptors=transfer.descriptors,
                                transfer_bytes=transfer.bytes, decode_blocks=memory.request_blocks),
            scheduling=scheduling or self.scheduling,
            warmup_requests=self.sweep.warmup_requests,
            measure_requests=self.sweep.measure_requests,
        )


def _concurrencies(values: Any) -> tuple[int, ...]:
    if not isinstance(values, list) or not values:
        raise ValueError(f"sweep.concurrency={values!r}: expected a non-empty list of integers")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"sweep.concurrency has {v!r}: expected integers >= 1")
    if list(values) != sorted(set(values)):
        raise ValueError(f"sweep.concurrency={values!r}: expected strictly increasing values")
    return tuple(values)


def _sources(data: Any, leaves: list[str]) -> dict[str, str]:
    if not isinstance(data, dict):
        raise ValueError("recipe needs a 'sources:' mapping from parameter path to its source")
    for key, text in data.items():
        if not isinstance(text, str) or text.split(":", 1)[0].strip() not in SOURCE_KINDS or ":" not in text:
            raise ValueError(
                f"sources[{key!r}]={text!r}: expected '<kind>: <where from>' with kind one of {', '.join(SOURCE_KINDS)}")
    missing = [leaf for leaf in leaves if leaf not in data]
    if missing:
        raise ValueError(f"recipe parameters without a source: {', '.join(missing)}")
    stray = sorted(set(data) - set(leaves))
    if stray:
        raise ValueError(f"sources name parameters the recipe does not have: {', '.join(stray)}")
    return dict(data)


def parse_recipe(data: Any, path: Path) -> Recipe:
    leaves: list[str] = []
    top = _Reader(data, "", leaves)
    name = top.raw("name", path.stem, leaf=False)
    top.raw("description", None, leaf=False)
    model = top.section("model")
    preset = model.text("preset")
    ssm_dtype = model.text("ssm_dtype", None)
    block_size = model.optional_int("block_size")
    model.done()
    workload = top.section("workload")
    isl, osl = workload.integer("isl"), workload.integer("osl")
    workload.done()
    pre = top.section("prefill")
    prefill = PrefillSpec(endpoints=pre.integer("endpoints"), ranks=pre.integer("ranks"),
                          max_batched_tokens=pre.integer("max_batched_tokens"), cost=_cost(pre.section("cost")))
    pre.done()
    dec = top.section("decode")
    decode_endpoints, decode_ranks = dec.integer("endpoints"), dec.integer("ranks")
    cache = dec.number("cache_bytes_per_rank")
    decode_cost = _cost(dec.section("cost"))
    dec.done()
    xfer = top.section("transfer")
    scheme = xfer.text("scheme")
    fragmentation = xfer.number("fragmentation", 1.0)
    if not 0.0 <= fragmentation <= 1.0:
        raise ValueError(f"transfer.fragmentation={fragmentation!r}: expected a fraction in [0, 1]")
    per_desc, bw = xfer.number("per_descriptor_s"), xfer.number("bytes_per_s")
    latency = xfer.number("latency_s", 0.0)
    posting = xfer.raw("posting_on_step", False)
    xfer.done()
    sched = top.section("scheduling")
    scheduling = Scheduling.parse(sched.raw("async"))
    sched.done()
    sw = top.section("sweep")
    stop = sw.raw("stop_at_capacity", True)
    if not isinstance(stop, bool):
        raise ValueError(f"sweep.stop_at_capacity={stop!r}: expected true or false")
    sweep = Sweep(concurrency=_concurrencies(sw.raw("concurrency")), stop_at_capacity=stop,
                  warmup_requests=sw.optional_int("warmup_requests"),
                  measure_requests=sw.optional_int("measure_requests"))
    sw.done()
    sources = _sources(top.raw("sources", leaf=False), leaves)
    top.done()
    if not isinstance(name, str) or not name:
        raise ValueError(f"recipe name={name!r}: expected a non-empty string")
    if not isinstance(preset, str):
        raise ValueError(f"model.preset={preset!r}: expected a preset name")
    if not isinstance(scheme, str):
        raise ValueError(f"transfer.scheme={scheme!r}: expected a scheme name")
    # Validate the numeric parts now, not at the first simulated point.
    LinkSpec(per_descriptor_s=per_desc, bytes_per_s=bw, latency_s=latency, posting_on_step=posting)
    RequestSpec(isl=isl, osl=osl, transfer_descriptors=0, transfer_bytes=0, decode_blocks=1)
    if not cache > 0:
        raise ValueError(f"decode.cache_bytes_per_rank={cache!r}: expected a positive number")
    for label, value in (("decode.endpoints", decode_endpoints), ("decode.ranks", decode_ranks)):
        if value < 1:
            raise ValueError(f"{label}={value!r}: expected an integer >= 1")
    return Recipe(name=name, path=path, preset=preset, ssm_dtype=ssm_dtype, block_size=block_size,
                  isl=isl, osl=osl, prefill=prefill, decode_endpoints=decode_endpoints,
                  decode_ranks=decode_ranks, cache_bytes_per_rank=cache, decode_cost=decode_cost,
                  scheme=scheme, fragmentation=fragmentation, per_descriptor_s=per_desc, bytes_per_s=bw, latency_s=latency,
                  posting_on_step=posting, scheduling=scheduling, sweep=sweep, sources=sources)


def load_recipe(path: str | Path) -> Recipe:
    """Read a recipe file; a bare name is looked up among the shipped recipes."""
    p = Path(path)
    if not p.exists() and not p.suffix and (RECIPE_DIR / f"{p.name}.yaml").exists():
        p = RECIPE_DIR / f"{p.name}.yaml"
    if not p.is_file():
        shipped = ", ".join(sorted(q.stem for q in RECIPE_DIR.glob("*.yaml")))
        raise ValueError(f"recipe {str(path)!r} is not a file (shipped recipes: {shipped})")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"recipe {p}: not valid YAML: {exc}") from None
    return parse_recipe(data, p)


def shipped_recipes() -> list[Path]:
    return sorted(RECIPE_DIR.glob("*.yaml"))
