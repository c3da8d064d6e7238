"""Local copies of staging: what a pack or unpack is (:class:`CopyStep`, or many as :class:`CopySteps`), and the
:class:`Copier` that checks and runs them on one side's memory (numpy on host memory; on a GPU the Triton row
gather of ``hybridkv.kernels.staging``, or torch's indexing, as :class:`GatherEngine` says).

A kernel-block unpack is over a thousand steps of a dozen rows each, so a stager hands them over as columns
(:class:`CopySteps`) and the copier checks bounds, picks element widths and builds the kernel's row table in numpy
passes over all of them at once: made and checked one object per step, the CPU was most of a staged fetch.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridkv import wire
from hybridkv.kernels.staging.reference import gather_rows_reference
from hybridkv.kernels.staging.rows import RowCopy, RowTable, address, table_of
from hybridkv.transport.memory import MemoryMap

GATHER_ENV = "HYBRIDKV_STAGING_GATHER"
#: the region code of this side's staging slot in :class:`CopySteps` (Place.region None)
SLOT = -1


class GatherEngine(enum.Enum):
    """What runs a GPU copier's gathers (host memory always gathers on numpy)."""

    AUTO = "auto"      # the Triton kernel where Triton imports, else torch's indexing
    TRITON = "triton"  # the Triton kernel; a run without Triton raises
    TORCH = "torch"    # torch's indexing over strided views (the kernel's oracle)


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


_I64 = np.int64


@dataclass(frozen=True, kw_only=True, eq=False)
class CopySteps:
    """Many :class:`CopyStep` as columns. Per step i: its places (``src_region[i]``, :data:`SLOT` for the staging
    slot, ``src_offset[i]``, ``src_stride[i]``, the same of dst) and ``length[i]``. Per row j (one page's piece):
    its step ``step[j]`` and pages ``src_pages[j]`` -> ``dst_pages[j]``; a step's rows lie together, in order,
    steps in order. All int64."""

    src_region: np.ndarray
    src_offset: np.ndarray
    src_stride: np.ndarray
    dst_region: np.ndarray
    dst_offset: np.ndarray
    dst_stride: np.ndarray
    length: np.ndarray
    step: np.ndarray
    src_pages: np.ndarray
    dst_pages: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.length.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes its rows move."""
        return int(self.length[self.step].sum())

    @classmethod
    def of(cls, steps: CopySteps | Sequence[CopyStep]) -> CopySteps:
        """``steps`` as columns (as given where they are)."""
        if isinstance(steps, CopySteps):
            return steps
        for s in steps:
            if s.src_pages.shape != s.dst_pages.shape or s.src_pages.ndim != 1:
                raise ValueError(f"copy of {s.src_pages.shape} source pages into {s.dst_pages.shape}; expected "
                                 "one destination page per source page")
        per = np.array([(SLOT if s.src.region is None else s.src.region, s.src.offset, s.src.stride,
                         SLOT if s.dst.region is None else s.dst.region, s.dst.offset, s.dst.stride, s.length)
                        for s in steps], dtype=_I64).reshape(-1, 7)
        n = np.array([s.src_pages.size for s in steps], dtype=_I64)
        return cls(src_region=per[:, 0], src_offset=per[:, 1], src_stride=per[:, 2], dst_region=per[:, 3],
                   dst_offset=per[:, 4], dst_stride=per[:, 5], length=per[:, 6],
                   step=np.repeat(np.arange(len(steps), dtype=_I64), n),
                   src_pages=_cat([s.src_pages for s in steps]), dst_pages=_cat([s.dst_pages for s in steps]))

    @classmethod
    def concat(cls, parts: Sequence[CopySteps | Sequence[CopyStep]]) -> CopySteps:
        """The steps of every part, in order (the step numbers of part k follow those of part k - 1)."""
        cols = [cls.of(p) for p in parts]
        shift = np.cumsum([0] + [c.num_steps for c in cols[:-1]], dtype=_I64)
        return cls(**{f: _cat([getattr(c, f) for c in cols]) for f in _STEP_FIELDS},
                   step=_cat([c.step + k for c, k in zip(cols, shift)]),
                   src_pages=_cat([c.src_pages for c in cols]), dst_pages=_cat([c.dst_pages for c in cols]))

    def steps(self) -> list[CopyStep]:
        """Back to one :class:`CopyStep` per step that has rows (for tests)."""
        return [CopyStep(src=_place(sr, so, ss), dst=_place(dr, do, ds), src_pages=self.src_pages[a:b],
                         dst_pages=self.dst_pages[a:b], length=n)
                for _, sr, so, ss, dr, do, ds, n, a, b in self.runs()]

    def runs(self) -> list[tuple[int, ...]]:
        """Per step that has rows, as Python ints: (step, src region, src offset, src stride, dst region, dst offset,
        dst stride, length, its first row, past its last row)."""
        first = np.searchsorted(self.step, np.arange(self.num_steps + 1, dtype=_I64)).tolist()
        return [r for r in zip(range(self.num_steps), self.src_region.tolist(), self.src_offset.tolist(),
                               self.src_stride.tolist(), self.dst_region.tolist(), self.dst_offset.tolist(),
                               self.dst_stride.tolist(), self.length.tolist(), first[:-1], first[1:]) if r[-1] > r[-2]]


_STEP_FIELDS = ("src_region", "src_offset", "src_stride", "dst_region", "dst_offset", "dst_stride", "length")


def _cat(arrays: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays).astype(_I64, copy=False) if len(arrays) else np.empty(0, dtype=_I64)


def _place(region: int, offset: int, stride: int) -> Place:
    return Place(region=None if region == SLOT else region, offset=offset, stride=stride)


def _host_bytes(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


class _CudaBytes:
    """A device range for torch.as_tensor (the CUDA array interface; no copy)."""

    def __init__(self, addr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (addr, False), "version": 3,
                                         "strides": None}


class Copier:
    """Runs copy steps (a :class:`CopyStep` list or :class:`CopySteps`) on one side's memory (its regions and its
    staging buffer): numpy on host memory; on a GPU the engine's gather (:class:`GatherEngine`)."""

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
        self._spans: dict[int, tuple[Any, int]] = {}  # region code -> (flat buffer, its address)
        self._max_word = max_word  # below 8 only to measure what the word buys (bench staging)
        self.engine = engine
        self._gather: Any = None  # a GPU run's gather function, resolved on the first one
        self._gather_table: Any = None  # the kernel's, over a row table (where the gather is the kernel)

    def _span(self, region: int | None):
        return self._span_at(SLOT if region is None else region)[0]

    def _span_at(self, region: int) -> tuple[Any, int]:
        """(the flat buffer region code ``region`` lies in, its address), looked up once per region (numpy's
        address costs microseconds)."""
        got = self._spans.get(region)
        if got is None:
            if region == SLOT:
                buf = self._buffer
            else:
                if not 0 <= region < len(self._memory.regions):
                    raise ValueError(f"a copy touches region {region}; expected one of this side's "
                                     f"{len(self._memory.regions)} regions")
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

    def _live(self, steps: CopySteps | Sequence[CopyStep]) -> tuple[CopySteps, np.ndarray, np.ndarray]:
        """``steps`` as columns, checked: every region a row touches looked up (its memory kind checked) and every
        row inside its span (:meth:`_check`); a bad step raises here, before any byte of any step moves (no
        half-applied pack). Also, per step, the address of its src span and of its dst span."""
        cols = CopySteps.of(steps)
        used = np.bincount(cols.step, minlength=cols.num_steps) > 0  # steps that have rows
        regions = np.unique(np.concatenate([cols.src_region[used], cols.dst_region[used]]))
        spans = {int(r): self._span_at(int(r)) for r in regions.tolist()}
        top = max(int(cols.src_region.max(initial=SLOT)), int(cols.dst_region.max(initial=SLOT)))
        lut = np.zeros((top + 2, 2), dtype=_I64)  # region code + 1 -> (size, address); 0 where no row goes
        for r, (buf, at) in spans.items():
            lut[r + 1] = (int(buf.shape[0]), at)
        self._check(cols, lut[:, 0])
        return cols, lut[cols.src_region + 1, 1], lut[cols.dst_region + 1, 1]

    @staticmethod
    def _check(cols: CopySteps, size: np.ndarray) -> None:
        """Every row inside its span (``size``: bytes by region code + 1): neither strided views nor the kernel's
        raw addresses check bounds, so a bad step must never touch memory past its span. Raises naming the first
        step that runs past."""
        for side in ("src", "dst"):
            region, offset, stride = (getattr(cols, f"{side}_{f}") for f in ("region", "offset", "stride"))
            pages, k = getattr(cols, f"{side}_pages"), cols.step
            bad = (pages < 0) | (offset[k] < 0) | (offset[k] + pages * stride[k] + cols.length[k] > size[region[k] + 1])
            if bad.any():
                i = int(k[np.argmax(bad)])
                mine = pages[k == i]
                lo, hi = int(mine.min()), int(mine.max())
                where = "the staging slot" if region[i] == SLOT else f"region {region[i]}"
                raise ValueError(f"copy of pages {lo}..{hi} ({cols.length[i]} bytes at offset {offset[i]}, stride "
                                 f"{stride[i]}) runs past {where} ({size[region[i] + 1]} bytes); expected it inside")

    def _words(self, cols: CopySteps, src_at: np.ndarray, dst_at: np.ndarray) -> np.ndarray:
        """Per step the widest element (8, 4, 2 or 1 bytes) that tiles both of its sides: a gather moves one
        element per index, so bytes one at a time ran at 1-4% of a plain copy on an H100 (bench staging)."""
        bits = cols.length | cols.src_offset | cols.src_stride | cols.dst_offset | cols.dst_stride | src_at | dst_at
        low = bits & -bits  # the lowest set bit: the widest power of two dividing every part (none where all are 0)
        return np.where((low == 0) | (low > self._max_word), self._max_word, low)

    def plan(self, steps: CopySteps | Sequence[CopyStep]) -> list[RowCopy]:
        """The row copies that run ``steps`` (empty ones dropped), checked (:meth:`_live`): what torch's or
        numpy's indexing runs."""
        cols, src_at, dst_at = self._live(steps)
        words = self._words(cols, src_at, dst_at).tolist()
        return [RowCopy(src=self._spans[sr][0], src_offset=so, src_stride=ss, src_rows=cols.src_pages[a:b],
                        dst=self._spans[dr][0], dst_offset=do, dst_stride=ds, dst_rows=cols.dst_pages[a:b],
                        length=n, word=words[i])
                for i, sr, so, ss, dr, do, ds, n, a, b in cols.runs()]

    def table(self, steps: CopySteps | Sequence[CopyStep]) -> RowTable:
        """``row_table(plan(steps))`` in numpy passes over the columns, no object per step: what the kernel runs."""
        cols, src_at, dst_at = self._live(steps)
        per = np.stack([src_at + cols.src_offset, cols.src_stride, dst_at + cols.dst_offset, cols.dst_stride,
                        cols.length, self._words(cols, src_at, dst_at)], axis=1)
        return table_of(per, cols.step, cols.src_pages, cols.dst_pages)

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

    def run(self, steps: CopySteps | Sequence[CopyStep]) -> None:
        if not self._vram:
            gather_rows_reference(self.plan(steps))
            return
        import torch

        if self.gpu_gather() is gather_rows_reference:
            copies = self.plan(steps)
            if not copies:
                return
            gather_rows_reference(copies)
        else:  # the kernel reads the row table, built from the columns
            rows = self.table(steps)
            if not rows.launches:
                return
            self._gather_table(rows, self._buffer.device)
        torch.cuda.synchronize(self._buffer.device)  # landed before anyone is told


__all__ = ["Copier", "CopyStep", "CopySteps", "GATHER_ENV", "GatherEngine", "Place", "SLOT"]
