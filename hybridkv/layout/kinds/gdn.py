"""Gated DeltaNet: a per-request state of conv rows (conv_dim, kernel-1) and SSM (HV, dv, dk), sharded by head."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import ClassVar

from hybridkv.layout.fields import Field, FieldKind, PageContent, align
from hybridkv.layout.kinds import LayerKind
from hybridkv.layout.kinds.base import ComponentKind, DType, LayerSpec, Paging, check_rank, positive


class ConvLayout(enum.Enum):
    """GDN conv-state layout. DS = (dim, state_len): each TP sub-block is one run."""

    DS = "DS"
    SD = "SD"


@dataclass(frozen=True, kw_only=True)
class GDNSpec(LayerSpec):
    """A Gated DeltaNet layer: conv state (conv_dim, kernel-1) and SSM state (HV, dv, dk)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int = 128
    head_v_dim: int = 128
    conv_kernel: int = 4
    conv_dtype: DType = DType.BFLOAT16
    ssm_dtype: DType = DType.FLOAT32
    conv_layout: ConvLayout = ConvLayout.DS

    kind: ClassVar[LayerKind] = LayerKind.GDN
    paging: ClassVar[Paging] = Paging.STATE
    # Engines move the conv and SSM states as separate transfers (SGLang #39846).
    components: ClassVar[tuple[ComponentKind, ...]] = (ComponentKind.CONV, ComponentKind.SSM)
    engine_tensors: ClassVar[int] = 2  # conv and SSM
    # vLLM 0.33 reads a state per conv Q, K, V run (DS layout) + SSM (docs/background/vllm.md section 4, #41869).
    page_sub_reads: ClassVar[int] = 4

    def __post_init__(self) -> None:
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"):
            positive(name, getattr(self, name))
        if not isinstance(self.conv_kernel, int) or self.conv_kernel < 2:
            raise ValueError(f"conv_kernel must be an int >= 2, got {self.conv_kernel!r}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"num_v_heads {self.num_v_heads} must be a multiple of num_k_heads {self.num_k_heads} (GVA)"
            )

    @property
    def v_heads_per_k_head(self) -> int:
        return self.num_v_heads // self.num_k_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def conv_shape(self) -> tuple[int, int]:
        state_len = self.conv_kernel - 1
        if self.conv_layout is ConvLayout.DS:
            return (self.conv_dim, state_len)
        return (state_len, self.conv_dim)

    @property
    def conv_bytes(self) -> int:
        return self.conv_dim * (self.conv_kernel - 1) * self.conv_dtype.itemsize

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_v_dim, self.head_k_dim)

    @property
    def ssm_bytes(self) -> int:
        return self.num_v_heads * self.head_v_dim * self.head_k_dim * self.ssm_dtype.itemsize

    @property
    def state_bytes(self) -> int:
        return self.conv_bytes + self.ssm_bytes

    @property
    def dtypes(self) -> tuple[DType, ...]:
        return (self.conv_dtype, self.ssm_dtype)

    def page_bytes(self, block_size: int) -> int:
        return self.state_bytes

    def shard(self, tp: int) -> GDNSpec:
        if self.num_k_heads % tp or self.num_v_heads % tp:
            raise ValueError(
                f"GDN heads (k={self.num_k_heads}, v={self.num_v_heads}) are not divisible by tp {tp}"
            )
        return replace(self, num_k_heads=self.num_k_heads // tp, num_v_heads=self.num_v_heads // tp)

    def with_ssm_dtype(self, dtype: DType) -> GDNSpec:
        return replace(self, ssm_dtype=dtype)

    def page_fields(self, layer: int, *, tp: int, rank: int, block_tokens: int | None,
                    content: PageContent | None) -> tuple[Field, ...]:
        if content is not PageContent.GDN:
            raise ValueError(f"GDN layer {layer} needs PageContent.GDN, got {content}")
        return gdn_page_fields(self, layer, tp=tp, rank=rank)

    def engine_content(self, *, head_outer: bool) -> PageContent:
        return PageContent.GDN

    def planned_fields(self, layers: tuple[int, ...], *, tp: int, rank: int,
                       block_size: int) -> tuple[tuple[Field, ...], int]:
        # GVA groups side by side, key-head-major across layers: a TP shard's key heads are one run.
        unit = gdn_unit_bytes(self)
        out: list[Field] = []
        at = 0
        for kh in k_heads_of_rank(self, tp, rank):
            for layer in layers:
                out.extend(gdn_group_unit_fields(self, layer, kh, offset=at))
                at += unit
        return tuple(out), at


def k_heads_of_rank(spec: GDNSpec, tp: int, rank: int) -> range:
    """Global GDN key-head indices held by `rank`; its value heads follow them (GVA groups)."""
    check_rank(tp, rank)
    per = spec.shard(tp).num_k_heads
    return range(rank * per, (rank + 1) * per)


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
