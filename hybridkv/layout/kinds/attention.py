"""Full and sliding-window attention: K|V pages of block_size tokens, sharded by KV head."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from hybridkv.layout.fields import Field, FieldKind, PageContent
from hybridkv.layout.kinds import LayerKind
from hybridkv.layout.kinds.base import ComponentKind, DType, LayerSpec, Paging, check_rank, positive


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(LayerSpec):
    """A full, sliding-window or chunked-local attention layer. K and V are both counted.

    MLA is one latent "head" per token that every TP rank holds whole: ``num_kv_heads=1``,
    ``head_dim_v=0`` (no separate V). Quantized caches: ``dtype`` is the storage type,
    ``encoding`` what the bytes mean (vLLM's kv-cache dtype, e.g. ``fp8_e4m3``), and
    ``head_token_bytes`` a head's bytes per token where the engine packs more than K|V
    (scales, packed latents) into it.
    """

    kind: LayerKind = LayerKind.FULL_ATTENTION
    num_kv_heads: int
    head_dim: int
    dtype: DType = DType.BFLOAT16
    window: int | None = None
    head_dim_v: int | None = None  # None: head_dim; 0: no V (MLA's latent)
    head_token_bytes: int | None = None
    encoding: str | None = None

    paging: ClassVar[Paging] = Paging.TOKENS
    components: ClassVar[tuple[ComponentKind, ...]] = (ComponentKind.KV,)
    engine_tensors: ClassVar[int] = 2  # K and V
    page_sub_reads: ClassVar[int] = 1  # K|V packed; a head-outer page's head slice is one run

    def __post_init__(self) -> None:
        if self.kind.spec_class is not AttentionSpec:
            raise ValueError(f"AttentionSpec kind must be an attention kind, got {self.kind}")
        positive("num_kv_heads", self.num_kv_heads)
        positive("head_dim", self.head_dim)
        if self.head_dim_v is not None and (not isinstance(self.head_dim_v, int) or self.head_dim_v < 0):
            raise ValueError(f"head_dim_v must be an int >= 0 or None, got {self.head_dim_v!r}")
        if self.head_token_bytes is not None:
            positive("head_token_bytes", self.head_token_bytes)
        if self.kind in (LayerKind.SLIDING_WINDOW, LayerKind.CHUNKED_LOCAL):
            if self.window is None:
                raise ValueError(f"a {self.kind.value} layer needs a window, got None")
            positive("window", self.window)
        elif self.window is not None:
            raise ValueError(f"a full-attention layer takes no window, got {self.window}")

    @classmethod
    def windowed(cls, *, window: int | None, chunked: bool = False, **fields) -> AttentionSpec:
        """The attention spec of a layer that keeps `window` tokens (None: all of them): sliding,
        or, with `chunked`, the current chunk of `window` tokens (chunked local attention)."""
        if window is None:
            return cls(**fields)
        return cls(kind=LayerKind.CHUNKED_LOCAL if chunked else LayerKind.SLIDING_WINDOW, window=window, **fields)

    @property
    def head_bytes_per_token(self) -> int:
        """K and V of one head for one token (vLLM 0.33 packs K|V in the content dim)."""
        if self.head_token_bytes is not None:
            return self.head_token_bytes
        v = self.head_dim if self.head_dim_v is None else self.head_dim_v
        return (self.head_dim + v) * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.num_kv_heads * self.head_bytes_per_token

    @property
    def dtypes(self) -> tuple[DType, ...]:
        return (self.dtype,)

    def page_bytes(self, block_size: int) -> int:
        return block_size * self.bytes_per_token

    def shard(self, tp: int) -> AttentionSpec:
        heads = self.num_kv_heads
        # vLLM replicates KV heads when TP exceeds them: each rank keeps one head.
        if tp > heads:
            if tp % heads:
                raise ValueError(f"tp {tp} must be a multiple of num_kv_heads {heads} when it exceeds them")
            return replace(self, num_kv_heads=1)
        if heads % tp:
            raise ValueError(f"num_kv_heads {heads} is not divisible by tp {tp}")
        return replace(self, num_kv_heads=heads // tp)

    def page_fields(self, layer: int, *, tp: int, rank: int, block_tokens: int | None,
                    content: PageContent | None) -> tuple[Field, ...]:
        if block_tokens is None:
            raise ValueError(f"attention layer {layer} needs a group with block_tokens")
        return attention_page_fields(self, layer, tp=tp, rank=rank, block_size=block_tokens, content=content)

    def engine_content(self, *, head_outer: bool) -> PageContent:
        return PageContent.ATTN_HND if head_outer else PageContent.ATTN_NHD

    def kernel_page_fields(self, layer: int, *, tp: int, rank: int, block_tokens: int | None,
                           kernel_tokens: int, content: PageContent | None) -> tuple[Field, ...]:
        """Fields of a page the engine splits into kernel blocks of `kernel_tokens` tokens, each laid
        out like a page of that many tokens. Token-major pages are unchanged by the split; in a
        head-outer page a head's tokens are one run per kernel block (FieldKind.KV_KERNEL)."""
        if block_tokens is None or kernel_tokens <= 0 or block_tokens % kernel_tokens:
            raise ValueError(f"attention layer {layer}: kernel blocks of {kernel_tokens} tokens do not tile its "
                             f"blocks of {block_tokens} tokens")
        if content is PageContent.ATTN_NHD or kernel_tokens == block_tokens:
            return self.page_fields(layer, tp=tp, rank=rank, block_tokens=block_tokens, content=content)
        if content is not PageContent.ATTN_HND:
            raise ValueError(f"attention pages are ATTN_HND or ATTN_NHD, got {content}")
        heads = kv_heads_of_rank(self, tp, rank)
        run = kernel_tokens * self.head_bytes_per_token
        return tuple(Field(key=(FieldKind.KV_KERNEL, layer, k * self.num_kv_heads + h),
                           offset=(k * len(heads) + i) * run, nbytes=run)
                     for k in range(block_tokens // kernel_tokens) for i, h in enumerate(heads))

    def planned_fields(self, layers: tuple[int, ...], *, tp: int, rank: int,
                       block_size: int) -> tuple[tuple[Field, ...], int]:
        # Head-major across layers: a rank's heads are one run of the block.
        tb = self.head_bytes_per_token
        head_page = block_size * tb
        out: list[Field] = []
        at = 0
        for h in kv_heads_of_rank(self, tp, rank):
            for layer in layers:
                out.append(Field(key=(FieldKind.KV, layer, h), offset=at, nbytes=head_page, token_bytes=tb))
                at += head_page
        return tuple(out), at


def heads_of_rank(total: int, tp: int, rank: int) -> range:
    """The global KV heads of ``total`` that rank ``rank`` of ``tp`` holds, as vLLM and SGLang shard them: a
    contiguous share, or where ``tp`` > ``total`` one head replicated over consecutive ranks (GQA)."""
    if tp > total:
        h = rank // (tp // total)
        return range(h, h + 1)
    per = total // tp
    return range(rank * per, (rank + 1) * per)


def kv_heads_of_rank(spec: AttentionSpec, tp: int, rank: int) -> range:
    """Global KV-head indices held by `rank` of `tp` (spec is the unsharded spec)."""
    check_rank(tp, rank)
    spec.shard(tp)  # validates divisibility
    return heads_of_rank(spec.num_kv_heads, tp, rank)


def attention_page_fields(spec: AttentionSpec, layer: int, *, tp: int, rank: int, block_size: int,
                          content: PageContent | None = PageContent.ATTN_HND) -> tuple[Field, ...]:
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
