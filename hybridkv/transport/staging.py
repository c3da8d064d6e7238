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

A pack or unpack is a list of :class:`CopyStep` gathers that a :class:`Copier` runs: numpy on host memory; on a
GPU the Triton row gather of ``hybridkv.kernels.staging`` where Triton imports (torch's indexing ran at 26-84 GB/s
on an H100, 2-6% of a plain copy), else torch's indexing. ``HYBRIDKV_STAGING_GATHER`` (read once, into
:class:`StagingConfig`) picks one: ``auto`` (default), ``triton`` or ``torch``.

The pool's memory is a region appended to the side's :class:`~hybridkv.transport.memory.MemoryMap`
(in no group), so NIXL registers it with the rest and the peer learns it in the handshake. torch and
Triton are imported only for GPU memory.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hybridkv import wire
from hybridkv.kernels.staging.reference import gather_rows_reference, rows_view
from hybridkv.kernels.staging.rows import RowCopy, RowTable, address, table_of
from hybridkv.transport.memory import MemoryMap
from hybridkv.transport.plan import TransferPlan

RULE_OFF_ENV = "HYBRIDKV_STAGING_RULE_OFF"
GATHER_ENV = "HYBRIDKV_STAGING_GATHER"


class StagingMode(enum.Enum):
    AUTO = "auto"  # stage a field-paired (heterogeneous TP) read when it posts fewer descriptors
    ON = "on"      # stage every field-paired read a slot can hold, even where the sliced plan is as short
    OFF = "off"    # never: the sliced plan, as NixlConnector posts


class GatherEngine(enum.Enum):
    """What runs a GPU copier's gathers (host memory always gathers on numpy)."""

    AUTO = "auto"      # the Triton kernel where Triton imports, else torch's indexing
    TRITON = "triton"  # the Triton kernel; a run without Triton raises
    TORCH = "torch"    # torch's indexing over strided views (the kernel's oracle)


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


# --------------------------------------------------------------------------- local copies


@dataclass(frozen=True, kw_only=True)
class Place:
    """Where a piece of page p lies: ``region`` (None: this side's staging slot) at
    ``offset + p * stride`` bytes from its base."""

    region: int | None
    offset: int
    stride: int


@dataclass(frozen=True, kw_only=True, eq=False)
class CopyStep:
    """One piece over many pages: ``length`` bytes of src page ``src_pages[i]`` to dst page
    ``dst_pages[i]``, for every i (one vectorised copy)."""

    src: Place
    dst: Place
    src_pages: np.ndarray
    dst_pages: np.ndarray
    length: int


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

    def pack(self, src_blocks, *, base: int = 0) -> list[CopyStep]:
        """Producer: its pages -> the slot at ``base`` in its staging buffer."""
        ...

    def read(self, slot_addr: int, slot_dev: int, src_blocks, dst_blocks) -> TransferPlan:
        """Consumer: the producer's slot at ``slot_addr`` -> its own pages, as rows."""
        ...

    def unpack(self, src_blocks, dst_blocks, *, base: int = 0) -> list[CopyStep]:
        """Consumer: its own slot at ``base`` (a copy of the producer's) -> its pages."""
        ...


def _starts(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Where each (non-empty) array starts in their concatenation: numpy's reduceat, one reduction per array."""
    return np.concatenate(([0], np.cumsum([a.size for a in arrays[:-1]], dtype=np.int64))).astype(np.int64)


def _host_bytes(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


class _CudaBytes:
    """A device range for torch.as_tensor (the CUDA array interface; no copy)."""

    def __init__(self, addr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (addr, False), "version": 3,
                                         "strides": None}


class Copier:
    """Runs :class:`CopyStep` lists on one side's memory (its regions and its staging buffer): numpy on host
    memory; on a GPU the engine's gather (:class:`GatherEngine`)."""

    def __init__(self, memory: MemoryMap, slot_buffer, *, max_word: int = 8,
                 engine: GatherEngine = GatherEngine.AUTO) -> None:
        if max_word not in (1, 2, 4, 8):
            raise ValueError(f"copier max_word = {max_word!r}; expected 1, 2, 4 or 8 bytes")
        if not isinstance(engine, GatherEngine):
            raise ValueError(f"copier engine {engine!r}; expected a GatherEngine")
        self._memory = memory
        self._buffer = slot_buffer  # numpy uint8 (host) or a torch uint8 tensor (device)
        # the slot's memory says where the copies run (a side's regions may mix kinds: SGLang's aux rows)
        self._vram = hasattr(slot_buffer, "device") and getattr(slot_buffer.device, "type", None) == "cuda"
        self._spans: dict[int, object] = {}
        self._max_word = max_word  # below 8 only to measure what the word buys (bench staging)
        self.engine = engine
        self._gather: Any = None  # a GPU run's gather function, resolved on the first one
        self._gather_table: Any = None  # the kernel's, over a row table (where the gather is the kernel)

    def _span(self, region: int | None):
        return self._span_at(region)[0]

    def _span_at(self, region: int | None) -> tuple[Any, int]:
        """(the flat buffer ``region`` lies in, its address): looked up once per region (numpy's address
        costs microseconds, and a kernel-block unpack runs thousands of steps)."""
        got = self._spans.get(region)
        if got is None:
            if region is None:
                buf = self._buffer
            else:
                r = self._memory.regions[region]
                if (r.mem is wire.Mem.VRAM) != bool(self._vram):
                    # a host view of device memory (or the reverse) would read or write the wrong bytes
                    raise ValueError(f"a copy touches region {region} in {r.mem.name}, the staging slot is in "
                                     f"{'VRAM' if self._vram else 'host memory'}; expected one memory kind")
                n = r.stride * (r.num_pages - 1) + r.page_bytes
                if self._vram:
                    import torch

                    buf = torch.as_tensor(_CudaBytes(r.base_addr, n), device=f"cuda:{r.device_id}")
                else:
                    buf = _host_bytes(r.base_addr, n)
            got = self._spans[region] = (buf, address(buf))
        return got

    def _check(self, steps: Sequence[CopyStep]) -> None:
        """Every page's piece of every step inside its span, checked at once (neither strided views nor the
        kernel's raw addresses check bounds: a bad step must never touch memory past its span). Raises naming
        the first step that runs past."""
        length = np.array([s.length for s in steps], dtype=np.int64)
        starts = _starts([s.src_pages for s in steps])
        for side in ("src", "dst"):
            places = [getattr(s, side) for s in steps]
            pages = np.concatenate([getattr(s, f"{side}_pages") for s in steps]).astype(np.int64, copy=False)
            lo, hi = np.minimum.reduceat(pages, starts), np.maximum.reduceat(pages, starts)
            offset = np.array([p.offset for p in places], dtype=np.int64)
            stride = np.array([p.stride for p in places], dtype=np.int64)
            sizes = {r: int(self._span(r).shape[0]) for r in {p.region for p in places}}
            size = np.array([sizes[p.region] for p in places], dtype=np.int64)
            bad = (lo < 0) | (offset < 0) | (offset + hi * stride + length > size)
            if bad.any():
                i = int(np.argmax(bad))
                where = "the staging slot" if places[i].region is None else f"region {places[i].region}"
                raise ValueError(f"copy of pages {lo[i]}..{hi[i]} ({length[i]} bytes at offset {offset[i]}, stride "
                                 f"{stride[i]}) runs past {where} ({size[i]} bytes); expected it inside")

    def _words(self, steps: Sequence[CopyStep]) -> np.ndarray:
        """Per step the widest element (8, 4, 2 or 1 bytes) that tiles both of its sides: a gather moves one
        element per index, so bytes one at a time ran at 1-4% of a plain copy on an H100 (bench staging)."""
        at = {r: a for r, (_, a) in self._spans.items()}  # every step's regions were checked, so looked up
        bits = np.array([s.length | s.src.offset | s.src.stride | s.dst.offset | s.dst.stride
                         | at[s.src.region] | at[s.dst.region] for s in steps], dtype=np.int64)
        low = bits & -bits  # the lowest set bit: the widest power of two dividing every part (none where all are 0)
        return np.where((low == 0) | (low > self._max_word), self._max_word, low)

    def _live(self, steps: Sequence[CopyStep]) -> list[CopyStep]:
        """The steps that move a byte, each checked in bounds and memory kind: a bad step raises here, before
        any byte of any step moves (no half-applied pack)."""
        steps = [s for s in steps if s.src_pages.size]
        for s in steps:
            if s.src_pages.shape != s.dst_pages.shape or s.src_pages.ndim != 1:
                raise ValueError(f"copy of {s.src_pages.shape} source pages into {s.dst_pages.shape}; expected "
                                 "one destination page per source page")
        for region in {p.region for s in steps for p in (s.src, s.dst)}:
            self._span_at(region)  # looked up (and its memory kind checked) once, for plan and table
        if steps:
            self._check(steps)
        return steps

    def plan(self, steps: Sequence[CopyStep]) -> list[RowCopy]:
        """The row copies that run ``steps`` (empty ones dropped), checked (:meth:`_live`): what torch's or
        numpy's indexing runs."""
        steps = self._live(steps)
        span = {r: buf for r, (buf, _) in self._spans.items()}
        return [RowCopy(src=span[s.src.region], src_offset=s.src.offset, src_stride=s.src.stride,
                        src_rows=s.src_pages, dst=span[s.dst.region], dst_offset=s.dst.offset,
                        dst_stride=s.dst.stride, dst_rows=s.dst_pages, length=s.length, word=w)
                for s, w in zip(steps, self._words(steps).tolist())]

    def table(self, steps: Sequence[CopyStep]) -> RowTable:
        """``row_table(plan(steps))`` without a row copy per step: what the kernel runs (a kernel-block unpack
        has over a thousand steps, and making each its object cost ~4 us)."""
        steps = self._live(steps)
        at = {r: a for r, (_, a) in self._spans.items()}
        per = np.array([(at[s.src.region] + s.src.offset, s.src.stride, at[s.dst.region] + s.dst.offset,
                         s.dst.stride, s.length) for s in steps], dtype=np.int64).reshape(-1, 5)
        per = np.concatenate([per, self._words(steps).reshape(-1, 1)], axis=1)
        return table_of(per, [s.src_pages for s in steps], [s.dst_pages for s in steps])

    def gpu_gather(self):
        """What runs this copier's GPU gathers (resolved once; Triton's import is tried only here): the Triton
        kernel, or torch's indexing where the engine says so or (AUTO) Triton does not import."""
        if self._gather is None:
            if self.engine is GatherEngine.TORCH:
                self._gather = gather_rows_reference
            else:
                try:
                    from hybridkv.kernels.staging.gather import gather_rows, gather_table
                except ImportError as e:
                    if self.engine is GatherEngine.TRITON:
                        raise RuntimeError(f"staging gather engine 'triton', but the Triton kernel does not import "
                                           f"({e}); expected Triton installed, or {GATHER_ENV}=torch") from e
                    self._gather = gather_rows_reference
                else:
                    self._gather, self._gather_table = gather_rows, gather_table
        return self._gather

    def run(self, steps: Sequence[CopyStep]) -> None:
        if not self._vram:
            gather_rows_reference(self.plan(steps))
            return
        import torch

        if self.gpu_gather() is gather_rows_reference:
            copies = self.plan(steps)
            if not copies:
                return
            gather_rows_reference(copies)
        else:  # the kernel reads the row table: built from the steps' columns, no row copy per step
            rows = self.table(steps)
            if not rows.launches:
                return
            self._gather_table(rows, self._buffer.device)
        torch.cuda.synchronize(self._buffer.device)  # landed before anyone is told


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


__all__ = ["BadFieldMask", "COSTS", "Copier", "CopyStep", "GATHER_ENV", "GatherEngine", "Place", "RULE_OFF_ENV", "Route", "Slot",
           "may_stage", "route", "rows_view", "StagePool", "Stager", "StagingConfig", "StagingMode", "slot_rows",
           "staging_region"]
