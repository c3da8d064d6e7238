"""What sits inside one page: named byte ranges ("fields") with a logical identity.

A field key says what the bytes *are* (component, layer, global head), so two
sides with different TP, block size or layout can be matched key by key. A field
with `token_bytes > 0` holds `[tokens][token_bytes]` contiguously and can be split
on token boundaries (different block sizes on the two sides).

What each kind's pages hold is the kind's own (``hybridkv.layout.kinds``: a spec's
``page_fields`` and ``planned_fields``); this module has the vocabulary they use.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class FieldKind(enum.Enum):
    KV = "kv"                    # K|V of one head, head-outer page (vLLM HND / LBHNC)
    KV_TOKEN_MAJOR = "kv_nhd"    # all local heads, token-outer page (vLLM NHD): not head-splittable
    CONV_Q = "conv_q"            # DS conv rows of one key head's Q channels
    CONV_K = "conv_k"
    CONV_V = "conv_v"            # DS conv rows of one value head's V channels
    CONV_SD = "conv_sd"          # SD conv state, all local channels: not head-splittable
    SSM = "ssm"                  # SSM state (dv, dk) of one value head
    OPAQUE = "opaque"            # an engine buffer's item moved as bytes (see layout.adopt_buffers)
    STATE = "state"              # one tensor of a recurrent state taken as a whole (kinds/state.py)
    KV_KERNEL = "kv_kernel"      # K|V of one head in one kernel block of a head-outer page split into
                                 # kernel blocks (head slot: kernel block * heads + head): not token-splittable


FieldKey = tuple[FieldKind, int, int]  # (component, layer, global head; first head for whole-rank fields)


@dataclass(frozen=True, kw_only=True)
class Field:
    key: FieldKey
    offset: int
    nbytes: int
    token_bytes: int = 0

    def shifted(self, delta: int) -> Field:
        return Field(key=self.key, offset=self.offset + delta, nbytes=self.nbytes, token_bytes=self.token_bytes)


class PageContent(enum.Enum):
    """How an engine lays out one layer's page (for adopting its tensors)."""

    ATTN_HND = "attn_hnd"   # [heads][tokens][K|V]
    ATTN_NHD = "attn_nhd"   # [tokens][heads][K|V]
    GDN = "gdn"             # [conv | ssm | pad], conv in the spec's conv layout


def align(n: int, to: int) -> int:
    return -(-n // to) * to
