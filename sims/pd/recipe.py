"""YAML recipes for `hybridkv sim pd`: read strictly, every parameter with its source.

A recipe names a model preset, a descriptor scheme, topology, cost figures, a workload
and a sweep. `sources:` maps each parameter's dotted path to where its value comes from,
written "cited: ...", "measured: ...", "derived: ..." or "assumed: ..."; a parameter
without a source is an error, so a recipe cannot quietly carry an unexplained number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from .params import (MAX_CONCURRENCY, MAX_LOADS, MAX_TP, MAX_REQUEST_RATE, MAX_SEEDS, MAX_WINDOW_REQUESTS, Arrivals,
                     DecodeSpec, Distribution, Lengths, LinkSpec, PostingSpec, PrefillSpec, Scheduling, SimConfig,
                     StepCost, Traffic, check_int, check_number)

SOURCE_KINDS = ("cited", "measured", "derived", "assumed")
RECIPE_DIR = Path(__file__).parent.parent / "recipes"
# Seeds per point when a recipe's sweep does not say (sweep.seeds): enough for a spread.
DEFAULT_SEEDS = 3


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
        check_number(self._key(key), float(value))
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
    # Every term is required: a cost left out is not silently free.
    cost = StepCost(**{k: reader.number(k) for k in StepCost.KEYS})
    reader.done()
    return cost


def _lengths(reader: _Reader, key: str) -> Lengths:
    name = reader._key(key)
    value = reader.raw(key)
    if isinstance(value, int) and not isinstance(value, bool):
        return Lengths.fixed(name, value)
    if not isinstance(value, dict):
        raise ValueError(f"{name}={value!r}: expected a token count or a mapping with 'distribution'")
    spec = _Reader(value, name, [])
    kind_text = spec.text("distribution")
    try:
        kind = Distribution(kind_text)
    except ValueError:
        names = ", ".join(d.value for d in Distribution if d is not Distribution.FIXED)
        raise ValueError(f"{name}.distribution={kind_text!r}: expected one of {names}") from None
    if kind is Distribution.UNIFORM:
        low, high = spec.integer("low"), spec.integer("high")
        out = Lengths(name=name, kind=kind, mean=(low + high) / 2, low=low, high=high)
    elif kind is Distribution.LOGNORMAL:
        out = Lengths(name=name, kind=kind, mean=spec.number("mean"), cv=spec.number("cv"),
                      low=spec.integer("low"), high=spec.integer("high"))
    else:
        raise ValueError(f"{name}: a fixed length is written as a plain integer")
    spec.done()
    return out


def _positive_bytes(reader: _Reader, key: str) -> float:
    value = reader.number(key)
    if not value > 0:
        raise ValueError(f"{reader._key(key)}={value!r}: expected a positive number of bytes")
    return value


@dataclass(frozen=True, kw_only=True)
class Sweep:
    arrivals: Arrivals
    # Users (closed loop) or requests per second (open loop), increasing.
    loads: tuple[float, ...]
    stop_at_capacity: bool
    warmup_requests: int | None
    measure_requests: int | None
    seeds: int


@dataclass(frozen=True, kw_only=True)
class Recipe:
    name: str
    path: Path
    preset: str
    ssm_dtype: str | None
    block_size: int | None
    # The attention backend's kernel block (FlashInfer: 16 tokens) when it splits the logical block;
    # vLLM 0.33 builds one id per kernel block, so the analyzer's count depends on it.
    kernel_block_size: int | None
    traffic: Traffic
    # Attention TP of a prefill and of a decode rank (1: the seed's DEP ranks). A rank is then that many
    # GPUs; the analyzer counts its reads at this TP pair (Sizing, sims/pd/model.py request_transfer).
    tp_prefill: int
    tp_decode: int
    prefill_endpoints: int
    prefill_ranks: int
    prefill_max_batched_tokens: int
    prefill_cache_bytes_per_rank: float
    prefill_cost: StepCost
    decode_endpoints: int
    decode_ranks: int
    # GPUs sharing one node's link (at attention TP 1, ranks); the simulated ranks per link are this / tp_decode.
    decode_ranks_per_node: int
    cache_bytes_per_rank: float
    decode_cost: StepCost
    scheme: str
    fragmentation: float
    posting: PostingSpec
    # Where each scheme posts: None = the thread its connector posts from (model.posts_on_step), or one
    # answer for every scheme compared.
    posting_on_step: bool | None
    link: LinkSpec
    scheduling: Scheduling
    sweep: Sweep
    sources: dict[str, str]

    def with_sweep(self, loads: tuple[float, ...] | None = None, *, arrivals: Arrivals | None = None,
                   warmup_requests: int | None = None, measure_requests: int | None = None,
                   seeds: int | None = None) -> Recipe:
        """The same recipe over other loads, a shorter window or other seeds (CLI overrides, CI's reduced sweep)."""
        arrivals = arrivals or self.sweep.arrivals
        sweep = replace(
            self.sweep, arrivals=arrivals,
            loads=_loads(list(loads), arrivals) if loads is not None else self.sweep.loads,
            warmup_requests=warmup_requests if warmup_requests is not None else self.sweep.warmup_requests,
            measure_requests=measure_requests if measure_requests is not None else self.sweep.measure_requests,
            seeds=seeds if seeds is not None else self.sweep.seeds)
        if loads is None and arrivals is not self.sweep.arrivals:
            raise ValueError(f"the recipe sweeps {self.sweep.arrivals.value}-loop loads; give the "
                             f"{arrivals.value}-loop ones (--concurrency or --request-rate)")
        check_int("seeds", sweep.seeds, maximum=MAX_SEEDS)
        return replace(self, sweep=sweep)

    def with_kernel_block_size(self, kernel_block_size: int) -> Recipe:
        """The recipe with another attention kernel block (checked against its logical block)."""
        from .model import check_kernel_block_size, model_geometry

        check_kernel_block_size(model_geometry(self.preset, self.ssm_dtype), block_size=self.block_size,
                                kernel_block_size=kernel_block_size, tp_prefill=self.tp_prefill,
                                tp_decode=self.tp_decode)
        return replace(self, kernel_block_size=kernel_block_size)

    def with_tp(self, tp_prefill: int | None = None, tp_decode: int | None = None) -> Recipe:
        """The recipe at another attention TP pair (checked against the heads, the node and the kernel
        block). Every cost stays as given, per rank: a what-if of the transfer, not of the TP's step."""
        out = replace(self, tp_prefill=tp_prefill or self.tp_prefill, tp_decode=tp_decode or self.tp_decode)
        _check_tp(out.preset, out.ssm_dtype, out.tp_prefill, out.tp_decode, out.decode_ranks_per_node,
                  out.block_size, out.kernel_block_size)
        return out

    def posting_for(self, scheme: str) -> PostingSpec:
        from .model import posts_on_step

        on_step = posts_on_step(scheme) if self.posting_on_step is None else self.posting_on_step
        return replace(self.posting, on_step=on_step)

    def sim_config(self, *, scheme: str | None = None, scheduling: Scheduling | None = None) -> SimConfig:
        """Resolve the model, the scheme's cache layout and the analyzer's counts into plain numbers.

        At attention TP t a rank's GPUs each hold a 1/t head slice of its blocks (the sharded geometry), so
        `cache_bytes_per_rank` (per GPU) holds that many blocks for the whole rank."""
        from .model import cache_model, model_geometry, sizing, transfer_workload

        scheme = scheme or self.scheme
        geometry = model_geometry(self.preset, self.ssm_dtype)
        # One block size for both sides, as the analyzer takes it (the larger HMA-aligned size of the two TPs).
        block = transfer_workload(geometry, tokens=1, block_size=self.block_size, tp_prefill=self.tp_prefill,
                                  tp_decode=self.tp_decode).effective_block_size
        decode = cache_model(geometry.shard(self.tp_decode), scheme, block_size=block)
        prefill = cache_model(geometry.shard(self.tp_prefill), scheme, block_size=block)
        size = sizing(geometry, scheme, block_size=self.block_size, kernel_block_size=self.kernel_block_size,
                      fragmentation=self.fragmentation, decode=decode, prefill=prefill,
                      tp_prefill=self.tp_prefill, tp_decode=self.tp_decode)
        return SimConfig(
            prefill=PrefillSpec(endpoints=self.prefill_endpoints, ranks=self.prefill_ranks,
                                max_batched_tokens=self.prefill_max_batched_tokens,
                                blocks_per_rank=prefill.per_rank(self.prefill_cache_bytes_per_rank,
                                                                 "prefill.cache_bytes_per_rank"),
                                cost=self.prefill_cost, gpus_per_rank=self.tp_prefill),
            decode=DecodeSpec(endpoints=self.decode_endpoints, ranks=self.decode_ranks,
                              ranks_per_node=self.decode_ranks_per_node // self.tp_decode,
                              blocks_per_rank=decode.per_rank(self.cache_bytes_per_rank, "decode.cache_bytes_per_rank"),
                              cost=self.decode_cost, gpus_per_rank=self.tp_decode),
            posting=self.posting_for(scheme), link=self.link, sizing=size, traffic=self.traffic,
            scheduling=scheduling or self.scheduling,
            warmup_requests=self.sweep.warmup_requests,
            measure_requests=self.sweep.measure_requests,
        )


#: transfer.posting.on_step's value for "where the scheme's own connector posts".
BY_SCHEME = "by-scheme"


def _check_tp(preset: str, ssm_dtype: str | None, tp_prefill: int, tp_decode: int, gpus_per_node: int,
              block_size: int | None, kernel_block_size: int | None) -> None:
    from .model import check_kernel_block_size, check_tp, model_geometry

    for key, value in (("prefill.attention_tp", tp_prefill), ("decode.attention_tp", tp_decode)):
        check_int(key, value, maximum=MAX_TP)
    if gpus_per_node % tp_decode:
        raise ValueError(f"decode.attention_tp={tp_decode}: a decode rank's GPUs must fit whole in a node of "
                         f"decode.ranks_per_node={gpus_per_node} GPUs (a rank spread over nodes' links is not modelled)")
    geometry = model_geometry(preset, ssm_dtype)
    check_tp(geometry, tp_prefill=tp_prefill, tp_decode=tp_decode)
    if kernel_block_size is not None:
        check_kernel_block_size(geometry, block_size=block_size, kernel_block_size=kernel_block_size,
                                tp_prefill=tp_prefill, tp_decode=tp_decode)


def _loads(values: Any, arrivals: Arrivals) -> tuple[float, ...]:
    key = "sweep.concurrency" if arrivals is Arrivals.CLOSED else "sweep.request_rate"
    if not isinstance(values, list) or not values:
        raise ValueError(f"{key}={values!r}: expected a non-empty list")
    if len(values) > MAX_LOADS:
        raise ValueError(f"{key} has {len(values)} points: above the bound {MAX_LOADS}")
    for v in values:
        if arrivals is Arrivals.CLOSED:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{key} has {v!r}: expected integers >= 1")
            if v > MAX_CONCURRENCY:
                raise ValueError(f"{key} has {v!r}: above the bound {MAX_CONCURRENCY:,} users")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{key} has {v!r}: expected finite request rates > 0 (requests per second)")
        elif v > MAX_REQUEST_RATE:
            raise ValueError(f"{key} has {v!r}: above the bound {MAX_REQUEST_RATE:,.0f} requests per second")
    if list(values) != sorted(set(values)):
        raise ValueError(f"{key}={values!r}: expected strictly increasing values")
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
    kernel_block_size = model.optional_int("kernel_block_size")
    model.done()
    workload = top.section("workload")
    traffic = Traffic(isl=_lengths(workload, "isl"), osl=_lengths(workload, "osl"),
                      ramp_s=workload.number("ramp_s"))
    workload.done()
    pre = top.section("prefill")
    # attention_tp (both sides): optional, 1 (the seed's DEP ranks) when left out.
    prefill = dict(endpoints=pre.integer("endpoints"), ranks=pre.integer("ranks"), tp=pre.integer("attention_tp", 1),
                   max_batched_tokens=pre.integer("max_batched_tokens"),
                   cache=_positive_bytes(pre, "cache_bytes_per_rank"), cost=_cost(pre.section("cost")))
    pre.done()
    dec = top.section("decode")
    decode = dict(endpoints=dec.integer("endpoints"), ranks=dec.integer("ranks"), tp=dec.integer("attention_tp", 1),
                  ranks_per_node=dec.integer("ranks_per_node"), cache=_positive_bytes(dec, "cache_bytes_per_rank"),
                  cost=_cost(dec.section("cost")))
    dec.done()
    xfer = top.section("transfer")
    scheme = xfer.text("scheme")
    fragmentation = xfer.number("fragmentation")
    if not 0.0 <= fragmentation <= 1.0:
        raise ValueError(f"transfer.fragmentation={fragmentation!r}: expected a fraction in [0, 1]")
    post = xfer.section("posting")
    on_step = post.raw("on_step")
    if on_step == BY_SCHEME:
        on_step = None
    elif not isinstance(on_step, bool):
        raise ValueError(f"transfer.posting.on_step={on_step!r}: expected true, false or {BY_SCHEME!r} (each "
                         "scheme where its connector posts: vLLM's on the decode step, hybridkv's on its own thread)")
    posting = PostingSpec(per_descriptor_s=post.number("per_descriptor_s"),
                          per_transfer_s=post.number("per_transfer_s"), on_step=bool(on_step))
    post.done()
    wire = xfer.section("link")
    link = LinkSpec(per_descriptor_s=wire.number("per_descriptor_s"), bytes_per_s=wire.number("bytes_per_s"),
                    latency_s=wire.number("latency_s"))
    wire.done()
    xfer.done()
    sched = top.section("scheduling")
    scheduling = Scheduling.parse(sched.raw("async"))
    sched.done()
    sw = top.section("sweep")
    stop = sw.raw("stop_at_capacity")
    if not isinstance(stop, bool):
        raise ValueError(f"sweep.stop_at_capacity={stop!r}: expected true or false")
    closed, opened = "concurrency" in sw.data, "request_rate" in sw.data
    if closed == opened:
        raise ValueError("recipe sweep needs exactly one of 'concurrency' (closed loop, users) and "
                         "'request_rate' (open loop, requests per second)")
    arrivals = Arrivals.CLOSED if closed else Arrivals.OPEN
    loads = _loads(sw.raw("concurrency" if closed else "request_rate"), arrivals)
    seeds = sw.integer("seeds", DEFAULT_SEEDS)
    check_int("sweep.seeds", seeds, maximum=MAX_SEEDS)
    window = {key: sw.optional_int(key) for key in ("warmup_requests", "measure_requests")}
    for key, value in window.items():
        if value is not None:
            check_int(f"sweep.{key}", value, minimum=0 if key == "warmup_requests" else 1,
                      maximum=MAX_WINDOW_REQUESTS)
    sweep = Sweep(arrivals=arrivals, loads=loads, stop_at_capacity=stop, seeds=seeds, **window)
    sw.done()
    sources = _sources(top.raw("sources", leaf=False), leaves)
    top.done()
    if not isinstance(name, str) or not name:
        raise ValueError(f"recipe name={name!r}: expected a non-empty string")
    if not isinstance(preset, str):
        raise ValueError(f"model.preset={preset!r}: expected a preset name")
    if not isinstance(scheme, str):
        raise ValueError(f"transfer.scheme={scheme!r}: expected a scheme name")
    from .model import check_scheme

    check_scheme(scheme)
    # Validate the counts now, not at the first simulated point (blocks come with the model).
    PrefillSpec(endpoints=prefill["endpoints"], ranks=prefill["ranks"], max_batched_tokens=prefill["max_batched_tokens"],
                blocks_per_rank=1, cost=prefill["cost"])
    DecodeSpec(endpoints=decode["endpoints"], ranks=decode["ranks"], ranks_per_node=decode["ranks_per_node"],
               blocks_per_rank=1, cost=decode["cost"])
    _check_tp(preset, ssm_dtype, prefill["tp"], decode["tp"], decode["ranks_per_node"], block_size, kernel_block_size)
    return Recipe(name=name, path=path, preset=preset, ssm_dtype=ssm_dtype, block_size=block_size,
                  kernel_block_size=kernel_block_size, traffic=traffic, tp_prefill=prefill["tp"],
                  tp_decode=decode["tp"],
                  prefill_endpoints=prefill["endpoints"], prefill_ranks=prefill["ranks"],
                  prefill_max_batched_tokens=prefill["max_batched_tokens"],
                  prefill_cache_bytes_per_rank=prefill["cache"], prefill_cost=prefill["cost"],
                  decode_endpoints=decode["endpoints"], decode_ranks=decode["ranks"],
                  decode_ranks_per_node=decode["ranks_per_node"], cache_bytes_per_rank=decode["cache"],
                  decode_cost=decode["cost"], scheme=scheme, fragmentation=fragmentation, posting=posting,
                  posting_on_step=on_step,
                  link=link, scheduling=scheduling, sweep=sweep, sources=sources)


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
