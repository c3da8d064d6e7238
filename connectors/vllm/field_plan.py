"""Field-level transfer plans for a decode rank: heterogeneous TP and different block sizes.

hybridkv's transport pairs whole pages when both sides cut them alike; otherwise
the consumer takes a plan (``hybridkv.transport.consumer.Plan``). This module
makes one from the descriptor compiler: :func:`descriptors.compiler.plan_sources`
says which producer rank feeds which field of this rank (GQA-replicated heads
read once), and a :class:`~descriptors.compiler.TransferPlanner` per producer
rank matches fields key by key (component, layer, global head), splitting
token-indexed fields on lcm super-pairs where block sizes differ. Importing it
does not import vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from descriptors.compiler import TransferPlanner, plan_sources

_EMPTY = np.zeros((0, 3), dtype=np.int64)


def source_ranks(local_tp: int, local_rank: int, remote_tp: int) -> tuple[tuple[int, ...], int]:
    """The producer ranks decode rank ``local_rank`` reads, and how many decode ranks
    read each of them (NixlConnector's TP mapping: D >= P reads a head slice of one P
    rank; P > D reads several P ranks)."""
    for name, v in (("local_tp", local_tp), ("remote_tp", remote_tp)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} = {v!r}; expected a positive int")
    if not 0 <= local_rank < local_tp:
        raise ValueError(f"local_rank = {local_rank}; expected 0..{local_tp - 1}")
    if remote_tp >= local_tp:
        if remote_tp % local_tp:
            raise ValueError(f"producer TP {remote_tp} is not a multiple of consumer TP {local_tp}")
        r = remote_tp // local_tp
        return tuple(range(local_rank * r, (local_rank + 1) * r)), 1
    if local_tp % remote_tp:
        raise ValueError(f"consumer TP {local_tp} is not a multiple of producer TP {remote_tp}")
    r = local_tp // remote_tp
    return (local_rank // r,), r


class FieldPlan:
    """A transport plan over the producer ranks one decode rank reads (a callable).

    ``peers``: those ranks' layouts as rebuilt from their handshakes. A rank that
    feeds no field (all its heads duplicate another's) gets an empty plan: the
    consumer tells it Done without reading.
    """

    def __init__(self, local, peers: Sequence, *, bridge_padding: bool = False) -> None:
        ranks = [p.rank for p in peers]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"producer ranks {ranks} repeat; expected one layout per rank")
        assigned = plan_sources(list(peers), local)
        self.sources: dict[int, frozenset] = {peers[i].rank: keys for i, keys in assigned.items()}
        self.planners: dict[int, TransferPlanner | None] = {
            p.rank: (TransferPlanner(p, local, keys=self.sources[p.rank], bridge_padding=bridge_padding)
                     if self.sources.get(p.rank) else None)
            for p in peers}

    def __call__(self, peer_layout, local_layout, peer_blocks: Mapping[int, np.ndarray],
                 local_blocks: Mapping[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        if peer_layout.rank not in self.planners:
            raise ValueError(f"producer rank {peer_layout.rank}; expected one of {sorted(self.planners)}")
        planner = self.planners[peer_layout.rank]
        if planner is None:
            return _EMPTY, _EMPTY
        groups = set(peer_blocks) & set(local_blocks)
        plan = planner.compile({g: peer_blocks[g] for g in groups}, {g: local_blocks[g] for g in groups})
        return plan.dst, plan.src  # the consumer reads: local rows are the plan's destination
