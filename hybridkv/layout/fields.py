"""What sits inside one page: named byte ranges ("fields") with a logical identity.

A field key says what the bytes *are* (component, layer, global head), so two
sides with different TP, block size or layout can be matched key by key. A field
with `token_bytes > 0` holds `[tokens][token_bytes]` contiguously and can be split
on token boundaries (different block sizes on the two sides).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hybridkv.layout.geometry import AttentionSpec, ConvLayout, GDNSpec, k_heads_of_rank, kv_heads_of_rank


class FieldKind(enum.Enum):
    KV = "kv"                    # K|V of one head, head-outer page (vLLM HND / LBHNC)
    KV_TOKEN_MAJOR = "kv_nhd"    # all local heads, token-outer page (vLLM NHD): not head-splittable
    CONV_Q = "conv_q"            # DS conv rows of one key head's Q channels
    CONV_K = "conv_k"
    CONV_V = "conv_v"            # DS conv rows of one value head's V channels
    CONV_SD = "conv_sd"          # SD conv state, all local channels: not head-splittable
    SSM = "ssm"                  # SSM state (dv, dk) of one value head
    OPAQUE = "opaque"            # an engine buffer's item moved as bytes (see layout.adopt_buffers)


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


def attention_page_fields(spec: AttentionSpec, layer: int, *, tp: int, rank: int, block_size: int,
                          content: PageContent = PageContent.ATTN_HND) -> tuple[Field, ...]:
    """Fields of one attention layer's page. `spec` is the unsharded spec."""
    heads = kv_heads_of_rank(spec, tp, rank)
    tb = spec.head_bytes_per_token
    if content is PageContent.ATTN_NHD:
        return (Field(key=(FieldKind.KV_TOKEN_MAJOR, layer, heads.start), offset=0,
                      nbytes=block_size * tb * len(heads), token_bytes=tb * len(heads)),)
    if content is not PageContent.ATTN_HND:
        raise ValueError(f"attention pages are ATTN_HND or ATTN_NHD, got {content}")
    head_page = block_size * tb
    return tuple(Field(key=(FieldKind.KV, layer, h), offset=i * head_page, nbytes=head_page, token_bytes=tb)
                 for i, h in enumerate(heads))


def gdn_group_unit_fields(spec: GDNSpec, layer: int, k_head: int, *, offset: int = 0) -> tuple[Field, ...]:
    """Fields of one GVA group (one key head and its value heads), DS conv rows then SSM.

    This is the unit hybridkv's planned layout puts side by side, so that any
    contiguous range of key heads (a TP shard) is one contiguous run.
    """
    row = (spec.conv_kernel - 1) * spec.conv_dtype.itemsize
    vpk = spec.v_heads_per_k_head
    fields = [
        Field(key=(FieldKind.CONV_Q, layer, k_head), offset=offset, nbytes=spec.head_k_dim * row),
        Field(key=(FieldKind.CONV_K, layer, k_head), offset=offset + spec.head_k_dim * row,
              nbytes=spec.head_k_dim * row),
    ]
    at = offset + 2 * spec.head_k_dim * row
    for j in range(vpk):
        fields.append(Field(key=(FieldKind.CONV_V, layer, k_head * vpk + j), offset=at, nbytes=spec.head_v_dim * row))
        at += spec.head_v_dim * row
    at = align(at, 16)
    ssm = spec.head_v_dim * spec.head_k_dim * spec.ssm_dtype.itemsize
    for j in range(vpk):
        fields.append(Field(key=(FieldKind.SSM, layer, k_head * vpk + j), offset=at, nbytes=ssm))
        at += ssm
    return tuple(fields)


def gdn_unit_bytes(spec: GDNSpec) -> int:
    last = gdn_group_unit_fields(spec, 0, 0)[-1]
    return align(last.offset + last.nbytes, 16)


def gdn_page_fields(spec: GDNSpec, layer: int, *, tp: int, rank: int) -> tuple[Field, ...]:
    """Fields of one GDN layer's engine page: [conv (per-rank) | ssm (per-rank)] (vLLM/SGLang)."""
    kheads = k_heads_of_rank(spec, tp, rank)
    local_k = len(kheads)
    vpk = spec.v_heads_per_k_head
    local_v = local_k * vpk
    itemsize = spec.conv_dtype.itemsize
    state_len = spec.conv_kernel - 1
    local_conv_dim = 2 * local_k * spec.head_k_dim + local_v * spec.head_v_dim
    conv_bytes = local_conv_dim * state_len * itemsize
    fields: list[Field] = []
    if spec.conv_layout is ConvLayout.SD:
        fields.append(Field(key=(FieldKind.CONV_SD, layer, kheads.start), offset=0, nbytes=conv_bytes))
    else:
        row = state_len * itemsize
        for i, kh in enumerate(kheads):
            fields.append(Field(key=(FieldKind.CONV_Q, layer, kh), offset=i * spec.head_k_dim * row,
                                nbytes=spec.head_k_dim * row))
        k_base = local_k * spec.head_k_dim * row
        for i, kh in enumerate(kheads):
            fields.append(Field(key=(FieldKind.CONV_K, layer, kh), offset=k_base + i * spec.head_k_dim * row,
                                nbytes=spec.head_k_dim * row))
        v_base = 2 * k_base
        for j in range(local_v):
            fields.append(Field(key=(FieldKind.CONV_V, layer, kheads.start * vpk + j),
                                offset=v_base + j * spec.head_v_dim * row, nbytes=spec.head_v_dim * row))
    ssm = spec.head_v_dim * spec.head_k_dim * spec.ssm_dtype.itemsize
    for j in range(local_v):
        fields.append(Field(key=(FieldKind.SSM, layer, kheads.start * vpk + j), offset=conv_bytes + j * ssm,
                            nbytes=ssm))
    return tuple(fields)


def align(n: int, to: int) -> int:
    return -(-n // to) * to
