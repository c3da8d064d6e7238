"""Staging for heterogeneous TP: a registered, bounded, fenced buffer that one read can cover.

At different attention TP every page is head-sliced, so a sliced plan posts one descriptor per
slice per block. With staging the producer *packs* what one consumer reads from it (that rank's
head slices of the request's pages, block by block: the "compact pages" a
:class:`Stager` defines) into a contiguous slot of its staging pool, and the consumer reads the
slot. Where the slot's bytes would still land in many pieces on the consumer (P > D: its pages
hold several producers' heads interleaved), the consumer reads the slot into a slot of its own
pool (one descriptor) and *unpacks* it locally.

A slot is a fenced resource with the rules of an exported block: the producer's slot is taken
when the Export is made and given back only when that export ends with its blocks (every reader's
Done or notification), or, where a reader may still be reading (lost, or failed while alive is
unknown), when the lease lapses. The consumer's slot is given back only when its READ ended
(landed, failed, or aborted; one NIXL would not abort keeps it until it ends). A pool is bounded:
when no slot is free the producer exports unstaged (the consumer then posts the sliced plan) and
the consumer reads directly: back-pressure falls back, it never waits (a Want that waited for a
slot could wait on the very reads that free it).

``HYBRIDKV_STAGING_RULE_OFF=1`` (read once, into :class:`StagingConfig`) switches the slot fence
off: a producer slot goes back as soon as its Export is sent. Only tests use it, to show that a
slot reused early corrupts a read.

A pack or unpack is copy steps (:mod:`hybridkv.transport.copies`, as columns where a stager has many) that a
:class:`Copier` runs: numpy on host memory; on a GPU the Triton row gather of ``hybridkv.kernels.staging`` where
Triton imports (torch's indexing ran at 26-84 GB/s on an H100, 2-6% of a plain copy), else torch's indexing.
``HYBRIDKV_STAGING_GATHER`` (read once, into :class:`StagingConfig`) picks one: ``auto`` (default), ``triton`` or
``torch``.

The pool's memory is a region appended to the side's :class:`~hybridkv.transport.memory.MemoryMap`
(in no group), so NIXL registers it with the rest and the peer learns it in the handshake. torch and
Triton are imported only for GPU memory.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hybridkv import wire
from hybridkv.kernels.staging.reference import rows_view
from hybridkv.transport.copies import GATHER_ENV, Copier, CopyStep, CopySteps, GatherEngine, Place
from hybridkv.transport.memory import MemoryMap
from hybridkv.transport.plan import TransferPlan

RULE_OFF_ENV = "HYBRIDKV_STAGING_RULE_OFF"


class StagingMode(enum.Enum):
    AUTO = "auto"  # stage a field-paired (heterogeneous TP) read when it posts fewer descriptors
    ON = "on"      # stage every field-paired read a slot can hold, even where the sliced plan is as short
    OFF = "off"    # never: the sliced plan, as NixlConnector posts


def _gather_engine() -> GatherEngine:
    text = os.environ.get(GATHER_ENV, "") or GatherEngine.AUTO.value
    try:
        return GatherEngine(text)
    except ValueError:
        raise ValueError(f"{GATHER_ENV}={text!r}; expected one of "
                         f"{', '.join(e.value for e in GatherEngine)}") from None


def _rule_off() -> bool:
    return os.environ.get(RULE_OFF_ENV, "") not in ("", "0")


@dataclass(frozen=True, kw_only=True)
class StagingConfig:
    """``capacity_bytes``: the pool (0: no pool, never stage on this side); ``slot_bytes``: its
    allocation unit. ``direct_rows``: a consumer reads a staged slot straight into its pages when
    that takes at most this many descriptors, else through a slot of its own and a local unpack.
    ``descriptor_us`` and ``copy_gbps``: what AUTO weighs (:func:`route`): the posting cost of a
    descriptor saved against the local copies staging adds; None: :data:`COSTS` for the memory kind.
    ``fence``: the slot fence (module docstring); off only through the environment, for the test
    that shows why it is there. ``gather``: what runs a GPU pack or unpack (:class:`GatherEngine`; default
    from ``HYBRIDKV_STAGING_GATHER``)."""

    mode: StagingMode = StagingMode.AUTO
    capacity_bytes: int = 64 << 20
    slot_bytes: int = 64 << 10
    direct_rows: int = 8
    descriptor_us: float | None = None
    copy_gbps: float | None = None
    fence: bool = field(default_factory=lambda: not _rule_off())
    gather: GatherEngine = field(default_factory=_gather_engine)

    def __post_init__(self) -> None:
        if not isinstance(self.mode, StagingMode):
            raise ValueError(f"staging mode {self.mode!r}; expected a StagingMode")
        if not isinstance(self.gather, GatherEngine):
            raise ValueError(f"staging gather {self.gather!r}; expected a GatherEngine")
        if self.capacity_bytes < 0 or self.slot_bytes <= 0 or self.capacity_bytes % self.slot_bytes:
            raise ValueError(f"staging capacity_bytes {self.capacity_bytes} and slot_bytes {self.slot_bytes}; "
                             "expected slot_bytes > 0 and a capacity that is a multiple of it (0: no pool)")
        if self.direct_rows < 1:
            raise ValueError(f"staging direct_rows = {self.direct_rows}; expected at least 1")
        for name in ("descriptor_us", "copy_gbps"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"staging {name} = {v!r}; expected a positive number or None")

    def costs(self, mem: wire.Mem) -> tuple[float, float]:
        """(us per descriptor posted, GB/s of a local gather copy) for memory of kind ``mem``."""
        us, gbps = COSTS[mem]
        return (us if self.descriptor_us is None else self.descriptor_us,
                gbps if self.copy_gbps is None else self.copy_gbps)

    @property
    def enabled(self) -> bool:
        return self.mode is not StagingMode.OFF and self.capacity_bytes > 0


class Route(enum.Enum):
    """How a consumer reads one producer's part of a request."""

    SLICED = "sliced"  # the producer's pages, head slice by head slice (NixlConnector's list)
    DIRECT = "direct"  # the producer's slot straight into this side's pages
    SLOT = "slot"      # the producer's slot into a slot of this side's (one descriptor), then unpacked


#: Per memory kind: (us of posting per descriptor, GB/s of a local gather copy). DRAM: measured on the
#: 2-core CPU box (posting curve ~2 us per descriptor, docs/benchmarks/transfer.md; a numpy gather of
#: 1.5-49 MB rows 0.6-1.0 GB/s under load). VRAM, one H100 (tools/device/results/): the posting curve's
#: 4.95 us per scattered descriptor, and a gather speed below the Triton kernel's own (100-288 GB/s): end to
#: end a staged fetch adds ~1.5 ms beside its gathers, and at 30 GB/s AUTO picked the faster fetch in both
#: layouts at TP 2 -> 1, 8,192 tokens (docs/benchmarks/transfer.md, "Staging at different TP"). The 500 GB/s
#: assumed once made AUTO stage where the sliced read was faster.
COSTS: dict[wire.Mem, tuple[float, float]] = {wire.Mem.DRAM: (2.0, 0.8), wire.Mem.VRAM: (4.95, 30.0)}


def route(config: StagingConfig | None, *, sliced: int, direct: int, own_pool: bool, nbytes: int = 0,
          mem: wire.Mem = wire.Mem.DRAM) -> Route:
    """The consumer's choice for a staged part of ``nbytes`` packed bytes, from the descriptor counts
    of the sliced plan and of the direct read (the one rule: the transport and the analyzer both call
    it). The staged read is the direct one where that takes at most ``direct_rows`` descriptors (or
    this side has no pool), else one descriptor into a slot of ours and an unpack. ON takes it
    whatever it costs. AUTO takes it only where the descriptors it saves cost more to post than the
    copies it adds (the producer's pack, and our unpack through a slot), at ``config.costs(mem)``:
    on a CPU host a descriptor is worth ~2 KB of copying, on a GPU ~150 KB."""
    if config is None or config.mode is StagingMode.OFF:
        return Route.SLICED
    way = Route.DIRECT if direct <= config.direct_rows or not own_pool else Route.SLOT
    staged = direct if way is Route.DIRECT else 1
    if staged > sliced:
        return Route.SLICED
    if config.mode is StagingMode.ON:
        return way
    us, gbps = config.costs(mem)
    copies = 1 if way is Route.DIRECT else 2
    return way if (sliced - staged) * us > copies * nbytes / (gbps * 1e3) else Route.SLICED


def may_stage(config: StagingConfig | None, *, sliced_most: int, direct: int, direct_most: int, own_pool: bool,
              nbytes_least: int, mem: wire.Mem = wire.Mem.DRAM) -> bool:
    """Before the Export: whether :func:`route` can pick a staged read for a part known only in bounds (a sliced
    plan of at most ``sliced_most`` descriptors, a direct read of ``direct`` to ``direct_most``, at least
    ``nbytes_least`` packed bytes). False: it picks SLICED whatever the Export brings, so a pack asked for would
    go unread. route stages only more for more sliced descriptors and fewer bytes, and for fewer direct rows
    while its way stays DIRECT (a SLOT read does not depend on them): the two corners decide."""
    return any(route(config, sliced=sliced_most, direct=d, own_pool=own_pool, nbytes=nbytes_least, mem=mem)
               is not Route.SLICED for d in {direct, direct_most})


# --------------------------------------------------------------------------- stagers (their copies: copies.py)


class BadFieldMask(ValueError):
    """A Want's field mask (wire.Want.fields) that names no field of the pair, or one past them: its Want is
    refused (a Failure naming it), the producer serves on."""


class Stager(Protocol):
    """What one producer packs for one consumer rank and how that rank reads it (made by a
    planner: ``hybridkv.descriptors.staging.StagePlan``). Block lists are the producer's
    (``src``) and the consumer's (``dst``) per group, as a sliced plan takes them; :meth:`nbytes`
    and :meth:`read` take only the count of each group's ``src`` blocks (the slot holds them in order),
    so a consumer can weigh a read before the Export names them."""

    #: whether every staged group's blocks hold as many tokens on both sides (then a producer exports as
    #: many blocks per group as the consumer reads, or more where the consumer had a prefix hit)
    same_blocks: bool
    #: what a Want names for the producer to pack (wire.Want.fields: a mask over the fields the pair shares;
    #: empty: every one). A consumer's stager packs only what it reads; a producer's, what the Want named.
    fields: bytes

    def nbytes(self, src_blocks) -> int:
        """Bytes the request's packed slices take."""
        ...

    def pack(self, src_blocks, *, base: int = 0) -> CopySteps | list[CopyStep]:
        """Producer: its pages -> the slot at ``base`` in its staging buffer."""
        ...

    def read(self, slot_addr: int, slot_dev: int, src_blocks, dst_blocks) -> TransferPlan:
        """Consumer: the producer's slot at ``slot_addr`` -> its own pages, as rows."""
        ...

    def unpack(self, src_blocks, dst_blocks, *, base: int = 0) -> CopySteps | list[CopyStep]:
        """Consumer: its own slot at ``base`` (a copy of the producer's) -> its pages."""
        ...


# --------------------------------------------------------------------------- the pool


@dataclass(eq=False, kw_only=True)
class Slot:
    """A run of pool units: bytes ``[offset, offset + nbytes)`` of the staging region."""

    first: int
    units: int
    offset: int
    nbytes: int


class StagePool:
    """One side's staging buffer: allocated and registered with the side's memory, handed out in
    contiguous runs of ``slot_bytes`` units, first fit. Slots given back with :meth:`hold` wait
    for their deadline (:meth:`tick`)."""

    def __init__(self, memory: MemoryMap, config: StagingConfig, *, mem: wire.Mem | None = None) -> None:
        """``mem``: the pool's memory kind where the side's regions mix kinds (SGLang's KV in VRAM, its metadata
        rows in host memory): the kind of the pages it packs, on the device of the first region of that kind.
        Default: the one kind of every region."""
        self.config = config
        self.units = config.capacity_bytes // config.slot_bytes
        kinds = {r.mem for r in memory.regions}
        if mem is not None and mem in kinds:
            kinds = {mem}
        if len(kinds) != 1:
            raise ValueError(f"staging over regions of memory kinds {sorted(k.name for k in kinds)}; "
                             "expected one kind (disable staging: StagingConfig(mode=StagingMode.OFF))")
        mem = kinds.pop()
        dev = next(r.device_id for r in memory.regions if r.mem is mem)
        self.buffer: Any  # numpy uint8 (host) or a torch uint8 tensor (device)
        if mem is wire.Mem.VRAM:
            import torch

            self.buffer = torch.zeros(config.capacity_bytes, dtype=torch.uint8, device=f"cuda:{dev}")
            base = int(self.buffer.data_ptr())
        else:
            self.buffer = np.zeros(config.capacity_bytes, dtype=np.uint8)
            base = int(self.buffer.ctypes.data)
        self.region = wire.RegionInfo(region_id=len(memory.regions), base_addr=base, stride=config.slot_bytes,
                                      page_bytes=config.slot_bytes, num_pages=self.units, mem=mem, device_id=dev)
        #: the side's memory with the pool appended (what its data plane registers and its Hello sends)
        self.memory = dataclasses.replace(memory, regions=memory.regions + (self.region,))
        self.copier = Copier(self.memory, self.buffer, engine=config.gather)
        self._used = np.zeros(self.units, dtype=bool)
        self._live: dict[int, Slot] = {}  # first unit -> the slot holding it
        self._held: list[tuple[float, Slot]] = []
        self.taken = 0       # counters, for tests and describe()
        self.full = 0

    @property
    def base(self) -> int:
        return self.region.base_addr

    def free_units(self) -> int:
        return int((~self._used).sum())

    def take(self, nbytes: int) -> Slot | None:
        """A slot of at least ``nbytes``, or None when no run that long is free (the caller falls back)."""
        units = -(-nbytes // self.config.slot_bytes)
        if nbytes <= 0 or units > self.units:
            self.full += nbytes > 0
            return None
        free = ~self._used
        # first index of a run of `units` free units: windowed sum over the free map
        c = np.concatenate(([0], np.cumsum(free, dtype=np.int64)))
        runs = np.flatnonzero(c[units:] - c[:-units] == units)
        if runs.size == 0:
            self.full += 1
            return None
        first = int(runs[0])
        self._used[first:first + units] = True
        self.taken += 1
        slot = self._live[first] = Slot(first=first, units=units, offset=first * self.config.slot_bytes,
                                        nbytes=nbytes)
        return slot

    def give_back(self, slot: Slot) -> None:
        if self._live.get(slot.first) is not slot:
            raise RuntimeError(f"staging slot at unit {slot.first} given back twice (or not this pool's)")
        del self._live[slot.first]
        self._used[slot.first:slot.first + slot.units] = False

    def hold(self, slot: Slot, until: float) -> None:
        """Give the slot back once ``tick(now)`` sees ``now >= until`` (a reader may still be reading)."""
        self._held.append((until, slot))

    def tick(self, now: float) -> None:
        if not self._held:
            return
        keep = []
        for until, slot in self._held:
            if now >= until:
                self.give_back(slot)
            else:
                keep.append((until, slot))
        self._held = keep

    def describe(self) -> dict:
        return {"units": self.units, "free": self.free_units(), "held": len(self._held), "taken": self.taken,
                "full": self.full}


def staging_region(memory: MemoryMap) -> wire.RegionInfo | None:
    """A peer's staging region: the one region no group places pages in (None without one)."""
    used = {r for g in memory.groups for r in g.region_ids}
    spare = [r for r in memory.regions if r.region_id not in used]
    return spare[-1] if len(spare) == 1 else None


def slot_rows(src_addr: int, src_dev: int, dst_addr: int, dst_dev: int, nbytes: int) -> TransferPlan:
    """One row: the producer's slot to the consumer's."""
    src = np.array([[src_addr, nbytes, src_dev]], dtype=np.int64)
    dst = np.array([[dst_addr, nbytes, dst_dev]], dtype=np.int64)
    z = np.zeros(1, dtype=np.int64)
    return TransferPlan(src=src, dst=dst, src_region=z, dst_region=z.copy())


__all__ = ["BadFieldMask", "COSTS", "Copier", "CopyStep", "CopySteps", "GATHER_ENV", "GatherEngine", "Place",
           "RULE_OFF_ENV", "Route", "Slot", "may_stage", "route", "rows_view", "StagePool", "Stager", "StagingConfig",
           "StagingMode", "slot_rows", "staging_region"]
