"""The identifiers every part of hybridkv shares, one definition each.

``NewType``s over ``int``/``str``: free at run time, but a type checker keeps a
block id from being passed where a group id is expected.
"""

from __future__ import annotations

from typing import NewType

#: A KV-cache group: layers of one kind that share a block table (vLLM's hybrid allocator groups).
GroupId = NewType("GroupId", int)
#: A logical block of one group; block b of a group lives in page b of each region it is placed in.
BlockId = NewType("BlockId", int)
#: A registered memory region of a :class:`~hybridkv.layout.Layout`.
RegionId = NewType("RegionId", int)
#: An engine's request id.
RequestId = NewType("RequestId", str)
#: A transfer posted through the :class:`~hybridkv.fencing.TransferScheduler`.
TransferId = NewType("TransferId", int)

__all__ = ["BlockId", "GroupId", "RegionId", "RequestId", "TransferId"]
