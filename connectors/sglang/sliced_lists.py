"""KV at different attention TP through NIXL prepped lists: made once per decode agent, indexed per chunk.

At different TP a KV page moves as head slices: one descriptor per (token, run of heads) of every page of
every layer buffer (pairing.py). Built as rows per chunk, each chunk makes NIXL check and build that many
descriptors again (`initialize_xfer`). SGLang's NIXL backend preps "slice" lists once per peer instead; so
does this: each piece of the KV planner's table (one slice of one layer buffer's page) becomes one strided
row `(addr, len, dev, stride, pages)` of a list prepped once per side when the decode agent registers,
and a chunk is one `make_prepped_xfer` of index arrays `first[piece] + page`, piece-major like the rows.
State and aux stay rows (few, and SGLang posts them so too).
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from hybridkv.descriptors.compiler import TransferPlanner
from hybridkv.errors import TransferError
from hybridkv.layout import Layout
from hybridkv.transport.dataplane import DataPlane, Op, Transfer

logger = logging.getLogger(__name__)


def _mem_name(layout: Layout, region_ids: np.ndarray) -> Optional[str]:
    kinds = {layout.region(int(r)).mem for r in np.unique(region_ids)}
    return kinds.pop().value if len(kinds) == 1 else None


class SlicedKV:
    """The KV group's slices to one decode agent as two prepped lists (this side's, the agent's)."""

    def __init__(self, *, dp: DataPlane, agent_name: str, planner: TransferPlanner, group: int) -> None:
        t = planner.tables[group]
        if t.src_blocks_per_pair != 1 or t.dst_blocks_per_pair != 1:  # SGLang's pages pair one to one
            raise ValueError(f"group {group} does not pair page to page; expected equal page sizes")
        local_mem, remote_mem = _mem_name(planner.src, t.s_region), _mem_name(planner.dst, t.d_region)
        if local_mem is None or remote_mem is None:
            raise ValueError(f"group {group} spans memory kinds; a prepped list has one")
        self._dp = dp
        self.agent_name = agent_name
        self.group = group
        self.pieces = t.num_pieces
        local = np.stack([t.s_base + t.s_off, t.length, t.s_dev, t.s_stride, t.s_pages], axis=1).astype(np.uint64)
        remote = np.stack([t.d_base + t.d_off, t.length, t.d_dev, t.d_stride, t.d_pages], axis=1).astype(np.uint64)
        #: index of page 0 of each piece in each list
        self._s_first = np.concatenate(([0], np.cumsum(t.s_pages)[:-1])).astype(np.int64)
        self._d_first = np.concatenate(([0], np.cumsum(t.d_pages)[:-1])).astype(np.int64)
        self._s_pages, self._d_pages = t.s_pages.astype(np.int64), t.d_pages.astype(np.int64)
        self._length = t.length.astype(np.int64)
        agent = dp.agent
        self._local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, local_mem)
        try:
            self._remote = agent.prep_xfer_dlist(agent_name, remote, remote_mem)
        except Exception:
            agent.release_dlist_handle(self._local)
            raise
        #: descriptors in the two lists (one per slice per page), built once
        self.listed = int(t.s_pages.sum() + t.d_pages.sum())

    def indices(self, src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(this side's, the agent's) list indices of a chunk's slices, piece-major as the planner's rows."""
        sb = np.asarray(src_pages, dtype=np.int64).ravel()
        db = np.asarray(dst_pages, dtype=np.int64).ravel()
        if sb.shape != db.shape:
            raise ValueError(f"{sb.shape[0]} source pages for {db.shape[0]} destination pages")
        if sb.size and (sb.min() < 0 or db.min() < 0 or sb.max() >= self._s_pages.min()
                        or db.max() >= self._d_pages.min()):
            raise ValueError(f"pages {sb.min()}..{sb.max()} -> {db.min()}..{db.max()} outside the KV pools "
                             f"({int(self._s_pages.min())} and {int(self._d_pages.min())} pages)")
        li = (self._s_first[:, None] + sb[None, :]).ravel().astype(np.int32)
        ri = (self._d_first[:, None] + db[None, :]).ravel().astype(np.int32)
        return li, ri

    def nbytes(self, pages: int) -> int:
        return int(self._length.sum()) * pages

    def post(self, src_pages: np.ndarray, dst_pages: np.ndarray) -> Transfer:
        """WRITE a chunk's KV slices; TransferError where NIXL refuses it (nothing runs then)."""
        li, ri = self.indices(src_pages, dst_pages)
        agent = self._dp.agent
        try:
            h = agent.make_prepped_xfer(Op.WRITE.value, self._local, li, self._remote, ri, b"")
        except Exception as exc:
            raise TransferError(f"NIXL refused the transfer to {self.agent_name}: {type(exc).__name__}: {exc}") \
                from exc
        xfer = Transfer([h], self.agent_name, int(li.size), self.nbytes(len(src_pages)))
        try:
            state = agent.transfer(h)
        except Exception as exc:
            state, err = "ERR", f"{type(exc).__name__}: {exc}"
        else:
            err = "ERR"
        if state == "ERR":
            self._dp.release(xfer)
            raise TransferError(f"posting to {self.agent_name} failed ({err})")
        return xfer

    def release(self) -> None:
        """Once no transfer of the agent runs (it retires): both lists go."""
        for h in (self._local, self._remote):
            try:
                self._dp.agent.release_dlist_handle(h)
            except Exception as e:  # NIXL's own error: the lists go with the agent at close
                logger.warning("hybridkv: releasing a prepped list of %s failed: %s", self.agent_name, e)
