"""KV at different attention TP through NIXL prepped lists: made once per decode agent, indexed per chunk.

At different TP a KV page moves as head slices: one descriptor per (token, run of heads) of every page of
every layer buffer (pairing.py). Built as rows per chunk, each chunk makes NIXL check and build that many
descriptors again (`initialize_xfer`). SGLang's NIXL backend preps "slice" lists once per peer instead; so
does this: each piece of the KV planner's table (one slice of one layer buffer's page) becomes one strided
row of a list prepped once per side when the decode agent registers (the core's
:class:`~hybridkv.transport.piece_lists.PieceLists`), and a chunk is one `make_prepped_xfer` of index arrays.
State and aux stay rows (few, and SGLang posts them so too). What is SGLang's here: its pages pair one to
one, and a table that does not is refused (rows per chunk then).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from hybridkv.descriptors.compiler import TransferPlanner
from hybridkv.layout import Layout
from hybridkv.transport.dataplane import DataPlane
from hybridkv.transport.piece_lists import PieceLists


def _mem_name(layout: Layout, region_ids: np.ndarray) -> Optional[str]:
    kinds = {layout.region(int(r)).mem for r in np.unique(region_ids)}
    return kinds.pop().value if len(kinds) == 1 else None


def sliced_kv(*, dp: DataPlane, agent_name: str, planner: TransferPlanner, group: int) -> PieceLists:
    """The KV group's slices to one decode agent as two prepped lists (this side's, the agent's); ValueError
    where the group does not pair page to page or spans memory kinds."""
    t = planner.tables[group]
    if t.src_blocks_per_pair != 1 or t.dst_blocks_per_pair != 1:  # SGLang's pages pair one to one
        raise ValueError(f"group {group} does not pair page to page; expected equal page sizes")
    local_mem, remote_mem = _mem_name(planner.src, t.s_region), _mem_name(planner.dst, t.d_region)
    if local_mem is None or remote_mem is None:
        raise ValueError(f"group {group} spans memory kinds; a prepped list has one")
    local = np.stack([t.s_base + t.s_off, t.length, t.s_dev, t.s_stride, t.s_pages], axis=1)
    remote = np.stack([t.d_base + t.d_off, t.length, t.d_dev, t.d_stride, t.d_pages], axis=1)
    return PieceLists(dp=dp, peer=agent_name, local=local, local_mem=local_mem, remote=remote, remote_mem=remote_mem)
