"""What a transfer moves, as the transport executes it, and who decides it.

The transport never pairs blocks itself. A :class:`Planner` turns one request's
block lists into a :class:`TransferPlan`; the consumer (pull) or the producer
(push) posts that plan as it is. hybridkv's planner is the descriptor compiler
(``hybridkv.descriptors.planning.DescriptorPlanner``, one layer up); connectors hand it to
the endpoints, so the count an analyzer computes and what NIXL posts come from
the same code.

In a plan ``src`` is always the producer's side and ``dst`` the consumer's,
whichever of them posts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from hybridkv.transport.config import Pairing
    from hybridkv.transport.memory import MemoryMap

_I64 = np.int64


@dataclass(frozen=True, kw_only=True, eq=False)
class TransferPlan:
    """Row i of ``src`` moves to row i of ``dst``: columns (addr, len, device), int64,
    already merged wherever two rows continue each other on both sides in one region.

    A plan of whole pages also has the *index form*: ``src_index``/``dst_index``, one
    int32 pair per page into each side's prepped list (the order of
    :meth:`~hybridkv.transport.memory.MemoryMap.strided_rows`), in row order and
    unmerged. ``make_prepped_xfer`` merges pairs consecutive on both sides back into
    the rows, so :attr:`num_descriptors` is what NIXL posts for either form.
    """

    src: np.ndarray
    dst: np.ndarray
    src_region: np.ndarray
    dst_region: np.ndarray
    src_index: np.ndarray | None = None
    dst_index: np.ndarray | None = None

    @property
    def num_descriptors(self) -> int:
        return int(self.src.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.src[:, 1].sum())

    @property
    def indexed(self) -> bool:
        """Whether the plan can be posted as prepped-list index pairs."""
        return self.src_index is not None

    @property
    def num_indices(self) -> int:
        """What is handed to NIXL: index pairs in the index form, else rows."""
        return int(self.src_index.shape[0]) if self.src_index is not None else self.num_descriptors

    def check(self) -> None:
        """ValueError unless the plan is well formed (a planner's output, before it is posted)."""
        s, d = self.src, self.dst
        if s.ndim != 2 or s.shape[1:] != (3,) or s.shape != d.shape:
            raise ValueError(f"plan rows of shapes {s.shape} and {d.shape}; expected equal Nx3")
        if self.src_region.shape != (s.shape[0],) or self.dst_region.shape != (s.shape[0],):
            raise ValueError(f"plan has {s.shape[0]} rows but region columns of shapes "
                             f"{self.src_region.shape} and {self.dst_region.shape}; expected one region per row")
        ls = s[:, 1]  # fewest numpy calls: this runs once per import on a cold core
        if ls.shape[0] and (ls.min() <= 0 or (ls != d[:, 1]).any()):
            raise ValueError("plan rows differ in length between the sides or are empty; "
                             "expected equal positive lengths row by row")
        if (self.src_index is None) != (self.dst_index is None):
            raise ValueError("plan has an index form on one side only; expected both or neither")
        if self.src_index is not None and (self.src_index.ndim != 1 or self.src_index.shape != self.dst_index.shape
                                           or self.src_index.shape[0] < s.shape[0]):
            raise ValueError(f"plan index arrays of shapes {self.src_index.shape} and {self.dst_index.shape} for "
                             f"{s.shape[0]} rows; expected equal 1-D arrays, at least one pair per row")

    @staticmethod
    def empty(*, indexed: bool = False) -> TransferPlan:
        """No rows; ``indexed``: with an (empty) index form too."""
        z3 = np.zeros((0, 3), dtype=_I64)
        z = np.zeros(0, dtype=_I64)
        zi = np.zeros(0, dtype=np.int32) if indexed else None
        return TransferPlan(src=z3, dst=z3.copy(), src_region=z, dst_region=z.copy(), src_index=zi,
                            dst_index=None if zi is None else zi.copy())

    @staticmethod
    def concat(plans: Sequence[TransferPlan]) -> TransferPlan:
        """All rows of several plans (the index form is dropped: it names one peer's lists)."""
        if not plans:
            return TransferPlan.empty()
        return TransferPlan(
            src=np.concatenate([p.src for p in plans]), dst=np.concatenate([p.dst for p in plans]),
            src_region=np.concatenate([p.src_region for p in plans]),
            dst_region=np.concatenate([p.dst_region for p in plans]),
        )


class PeerPlanner(Protocol):
    """A planner prepared for one import's producers: the static part, made once per set of peers."""

    def plan(self, source: int, source_blocks: Mapping[int, np.ndarray],
             dest_blocks: Mapping[int, np.ndarray]) -> TransferPlan:
        """What producer ``sources[source]`` sends for one request: its blocks per group to the
        consumer's. Raises ValueError when the block lists do not pair (naming the group)."""
        ...


class Planner(Protocol):
    """Pairs blocks for the transport; an endpoint is built with one."""

    @property
    def pairing(self) -> Pairing:
        """What this side's handshake promises: PAGES (both sides cut pages alike) or FIELDS
        (field tables travel, page shapes may differ)."""
        ...

    def prepare(self, sources: Sequence[MemoryMap], dest: MemoryMap) -> PeerPlanner:
        """The pairing of ``dest`` (the consumer) with every producer one import reads, in the
        order given. Raises ValueError when they cannot be paired."""
        ...


__all__ = ["PeerPlanner", "Planner", "TransferPlan"]
