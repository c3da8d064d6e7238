"""Pieces prepped once per peer as two NIXL lists, a transfer as index arrays into them.

Where a block moves as several pieces (head slices at different TP: one piece per slice of one region's
page), building each transfer as rows makes NIXL check and build every descriptor again
(``initialize_xfer``). Here each piece is one strided row ``(addr, len, dev, stride, count)`` (its entry
``e`` lies at ``addr + e * stride``) of a list prepped once per side (this agent's, the peer's), and a
transfer is one ``make_prepped_xfer`` of index arrays ``first[piece] + entry``, piece-major.
:class:`~hybridkv.transport.dataplane.DataPlane`'s own lists are the special case of one piece per region
(whole pages); these are for the tables a caller builds itself (SGLang's KV at different attention TP).
"""

from __future__ import annotations

import logging

import numpy as np

from hybridkv.errors import TransferError
from hybridkv.transport.dataplane import DataPlane, Op, Transfer

log = logging.getLogger(__name__)


def _first(counts: np.ndarray) -> np.ndarray:
    """Index of entry 0 of each piece in its list."""
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)


class PieceLists:
    """One peer's pieces: ``local`` and ``remote`` are Nx5 strided rows (addr, len, dev, stride, count), piece
    ``i`` of one side paired with piece ``i`` of the other (same ``len``), each side in one memory kind
    (``local_mem``, ``remote_mem``: a :class:`~hybridkv.wire.Mem` name)."""

    def __init__(self, *, dp: DataPlane, peer: str, local: np.ndarray, local_mem: str, remote: np.ndarray,
                 remote_mem: str) -> None:
        lr = np.asarray(local, dtype=np.uint64)
        rr = np.asarray(remote, dtype=np.uint64)
        if lr.ndim != 2 or lr.shape[1] != 5 or lr.shape != rr.shape or not lr.shape[0]:
            raise ValueError(f"strided rows of shapes {lr.shape} and {rr.shape}; expected equal non-empty Nx5")
        if not np.array_equal(lr[:, 1], rr[:, 1]):
            raise ValueError("pieces of different lengths on the two sides; expected each piece's bytes to match")
        self._dp = dp
        self.peer = peer
        self.pieces = int(lr.shape[0])
        self._l_first, self._r_first = _first(lr[:, 4]), _first(rr[:, 4])
        self._l_count, self._r_count = lr[:, 4].astype(np.int64), rr[:, 4].astype(np.int64)
        self._length = lr[:, 1].astype(np.int64)
        agent = dp.agent
        self._local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", lr, local_mem)
        try:
            self._remote = agent.prep_xfer_dlist(peer, rr, remote_mem)
        except Exception:
            agent.release_dlist_handle(self._local)
            raise
        #: descriptors in the two lists (one per entry of each piece), built once
        self.listed = int(self._l_count.sum() + self._r_count.sum())

    def indices(self, local_entries: np.ndarray, remote_entries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(this side's, the peer's) list indices of every piece of the given entries, piece-major; ValueError
        for an entry outside a piece (nothing is posted then)."""
        le = np.asarray(local_entries, dtype=np.int64).ravel()
        re = np.asarray(remote_entries, dtype=np.int64).ravel()
        if le.shape != re.shape:
            raise ValueError(f"{le.shape[0]} source pages for {re.shape[0]} destination pages")
        if le.size and (le.min() < 0 or re.min() < 0 or le.max() >= self._l_count.min()
                        or re.max() >= self._r_count.min()):
            raise ValueError(f"pages {le.min()}..{le.max()} -> {re.min()}..{re.max()} outside the listed pools "
                             f"({int(self._l_count.min())} and {int(self._r_count.min())} pages)")
        li = (self._l_first[:, None] + le[None, :]).ravel().astype(np.int32)
        ri = (self._r_first[:, None] + re[None, :]).ravel().astype(np.int32)
        return li, ri

    def nbytes(self, entries: int) -> int:
        return int(self._length.sum()) * entries

    def post(self, op: Op, local_entries: np.ndarray, remote_entries: np.ndarray) -> Transfer:
        """Post the entries' pieces; TransferError where NIXL refuses it (nothing runs then)."""
        li, ri = self.indices(local_entries, remote_entries)
        agent = self._dp.agent
        try:
            h = agent.make_prepped_xfer(op.value, self._local, li, self._remote, ri, b"")
        except Exception as exc:
            raise TransferError(f"NIXL refused the transfer to {self.peer}: {type(exc).__name__}: {exc}") from exc
        xfer = Transfer([h], self.peer, int(li.size), self.nbytes(len(local_entries)))
        try:
            state = agent.transfer(h)
        except Exception as exc:
            state, err = "ERR", f"{type(exc).__name__}: {exc}"
        else:
            err = "ERR"
        if state == "ERR":
            self._dp.release(xfer)
            raise TransferError(f"posting to {self.peer} failed ({err})")
        return xfer

    def release(self) -> None:
        """Once no transfer through them runs (the peer leaves): both lists go."""
        for h in (self._local, self._remote):
            try:
                self._dp.agent.release_dlist_handle(h)
            except Exception as e:  # NIXL's own error: the lists go with the agent at close
                log.warning("hybridkv: releasing a prepped list of %s failed: %s", self.peer, e)


__all__ = ["PieceLists"]
