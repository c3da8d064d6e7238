"""What the bytes of each SGLang transfer buffer are, per rank: the input of field keys.

SGLang's `KVArgs` says enough to know which slice of the model a rank's item
holds, and SGLang's own backends slice with exactly this metadata
(`compute_head_slice_params`, `compute_mamba_state_slice_byte_blocks`):

* a KV buffer's item is one page of one layer, NHD: `[page_size][local heads]
  [head bytes]`; attention TP shards the `total_kv_head_num` heads (a rank
  holds `max(1, H // tp)` of them; when tp > H, consecutive ranks share one);
  an MLA latent page is the same on every rank;
* a Mamba state item (one slot of one layer of one state tensor) is
  `[outer][local dims][...]`; `state_dim_per_tensor` is the local size of the
  sharded axis (0: the item is replicated), `state_slice_outer_counts` the rows
  before it, `state_conv_shard_groups` the full sizes of the sub-blocks that
  are sharded independently (GDN conv: `[key_dim, key_dim, value_dim]`);
* aux rows are the same on every rank;
* anything else (other state types) is "this rank's bytes", only paired with
  the same rank of an equal-TP peer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hybridkv.transport.settings import is_int, require


class Slicing(enum.Enum):
    HEADS = "heads"  # KV page, NHD, heads sharded by attention TP
    DIMS = "dims"  # state item, one axis sharded by attention TP (optionally in sub-blocks)
    WHOLE = "whole"  # identical on every rank (aux rows, replicated state, MLA latent pages)
    RANK = "rank"  # this rank's bytes in an unknown arrangement: equal TP only


@dataclass(frozen=True, kw_only=True)
class BufferShape:
    slicing: Slicing
    dim: int = 0  # DIMS: local size of the sharded axis
    outer: int = 1  # DIMS: rows before the sharded axis
    sub: tuple[int, ...] = ()  # DIMS: full sizes of independently sharded sub-blocks (empty: one block)
    conv: bool = False  # DIMS: a conv state (its sub-blocks are GDN's q, k, v)


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """How a side is sharded, and what every rank of it has in common."""

    attn_tp: int = 1
    attn_rank: int = 0
    state_tp: int = 1  # the width linear attention (GDN) shards its heads over
    page_size: int = 1
    kv_heads: int = 1  # total KV heads of the model (1 for MLA)
    mla: bool = False
    kv_layout: str | None = None  # None: SGLang's standard NHD pages
    draft_entries: int = 0  # speculative draft KV buffers appended to the KV lists

    def __post_init__(self) -> None:
        for name in ("attn_tp", "state_tp", "page_size", "kv_heads"):
            v = getattr(self, name)
            require(is_int(v) and v > 0, name, v, "a positive int")
        require(is_int(self.attn_rank) and 0 <= self.attn_rank < self.attn_tp, "attn_rank", self.attn_rank,
                f"0..{self.attn_tp - 1}")
        require(is_int(self.draft_entries) and self.draft_entries >= 0, "draft_entries", self.draft_entries,
                "an int >= 0")
