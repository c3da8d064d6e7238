"""What a hybrid model's caches are: layer kinds, their specs, and TP sharding.

Every spec computes its own bytes. Nothing here knows about pages, blocks or
engines: that is `hma` (grouping) and `layout` (where bytes live).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace


class LayerKind(enum.Enum):
    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    GDN = "gdn"

    @property
    def is_attention(self) -> bool:
        return self is not LayerKind.GDN


class DType(enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT8_E4M3 = "float8_e4m3"

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FLOAT32 else 1 if self is DType.FLOAT8_E4M3 else 2

    @classmethod
    def parse(cls, value: str | DType, *, what: str = "dtype") -> DType:
        if isinstance(value, DType):
            return value
        aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                   "float": "float32", "fp8": "float8_e4m3", "float8_e4m3fn": "float8_e4m3"}
        name = aliases.get(str(value).lower(), str(value).lower())
        try:
            return cls(name)
        except ValueError:
            choices = ", ".join(d.value for d in cls)
            raise ValueError(f"{what} {value!r} is not one of: {choices}") from None


class ConvLayout(enum.Enum):
    """GDN conv-state layout. DS = (dim, state_len): each TP sub-block is one run."""

    DS = "DS"
    SD = "SD"


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """A full or sliding-window attention layer. K and V are both counted."""

    kind: LayerKind = LayerKind.FULL_ATTENTION
    num_kv_heads: int
    head_dim: int
    dtype: DType = DType.BFLOAT16
    window: int | None = None

    def __post_init__(self) -> None:
        if not self.kind.is_attention:
            raise ValueError(f"AttentionSpec kind must be an attention kind, got {self.kind}")
        _positive("num_kv_heads", self.num_kv_heads)
        _positive("head_dim", self.head_dim)
        if self.kind is LayerKind.SLIDING_WINDOW:
            if self.window is None:
                raise ValueError("a sliding-window layer needs a window, got None")
            _positive("window", self.window)
        elif self.window is not None:
            raise ValueError(f"a full-attention layer takes no window, got {self.window}")

    @property
    def head_bytes_per_token(self) -> int:
        """K and V of one head for one token (vLLM 0.33 packs K|V in the content dim)."""
        return 2 * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.num_kv_heads * self.head_bytes_per_token

    def page_bytes(self, block_size: int) -> int:
        return block_size * self.bytes_per_token


@dataclass(frozen=True, kw_only=True)
class GDNSpec:
    """A Gated DeltaNet layer: conv state (conv_dim, kernel-1) and SSM state (HV, dv, dk)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int = 128
    head_v_dim: int = 128
    conv_kernel: int = 4
    conv_dtype: DType = DType.BFLOAT16
    ssm_dtype: DType = DType.FLOAT32
    conv_layout: ConvLayout = ConvLayout.DS

    kind = LayerKind.GDN

    def __post_init__(self) -> None:
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"):
            _positive(name, getattr(self, name))
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


LayerSpec = AttentionSpec | GDNSpec


@dataclass(frozen=True, kw_only=True)
class ModelGeometry:
    """A model's cache-bearing layers in order. `tp` is the sharding this geometry describes."""

    name: str
    layers: tuple[LayerSpec, ...]
    tp: int = 1

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"model {self.name!r} has no layers")
        _positive("tp", self.tp)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def kinds(self) -> tuple[LayerKind, ...]:
        """Kinds present, in first-appearance order."""
        seen: list[LayerKind] = []
        for spec in self.layers:
            if spec.kind not in seen:
                seen.append(spec.kind)
        return tuple(seen)

    def layer_indices(self, kind: LayerKind) -> tuple[int, ...]:
        return tuple(i for i, spec in enumerate(self.layers) if spec.kind is kind)

    def spec_of(self, kind: LayerKind) -> LayerSpec:
        """The spec shared by every layer of `kind` (hybrid models are uniform per kind)."""
        specs = {self.layers[i] for i in self.layer_indices(kind)}
        if len(specs) != 1:
            raise ValueError(f"model {self.name!r} has {len(specs)} different specs for {kind.value}")
        return specs.pop()

    def with_ssm_dtype(self, dtype: DType) -> ModelGeometry:
        layers = tuple(replace(s, ssm_dtype=dtype) if isinstance(s, GDNSpec) else s for s in self.layers)
        return replace(self, layers=layers)

    def shard(self, tp: int) -> ModelGeometry:
        """The per-rank geometry at tensor parallelism `tp` (from an unsharded geometry)."""
        if self.tp != 1:
            raise ValueError(f"shard() takes an unsharded geometry, this one is already at tp={self.tp}")
        _positive("tp", tp)
        return replace(self, layers=tuple(shard_layer(s, tp) for s in self.layers), tp=tp)


def shard_layer(spec: LayerSpec, tp: int) -> LayerSpec:
    if isinstance(spec, AttentionSpec):
        heads = spec.num_kv_heads
        # vLLM replicates KV heads when TP exceeds them: each rank keeps one head.
        if tp > heads:
            if tp % heads:
                raise ValueError(f"tp {tp} must be a multiple of num_kv_heads {heads} when it exceeds them")
            return replace(spec, num_kv_heads=1)
        if heads % tp:
            raise ValueError(f"num_kv_heads {heads} is not divisible by tp {tp}")
        return replace(spec, num_kv_heads=heads // tp)
    if spec.num_k_heads % tp or spec.num_v_heads % tp:
        raise ValueError(
            f"GDN heads (k={spec.num_k_heads}, v={spec.num_v_heads}) are not divisible by tp {tp}"
        )
    return replace(spec, num_k_heads=spec.num_k_heads // tp, num_v_heads=spec.num_v_heads // tp)


def kv_heads_of_rank(spec: AttentionSpec, tp: int, rank: int) -> range:
    """Global KV-head indices held by `rank` of `tp` (spec is the unsharded spec)."""
    _check_rank(tp, rank)
    heads = spec.num_kv_heads
    if tp > heads:
        shard_layer(spec, tp)  # validates divisibility
        h = rank // (tp // heads)
        return range(h, h + 1)
    per = shard_layer(spec, tp).num_kv_heads
    return range(rank * per, (rank + 1) * per)


def k_heads_of_rank(spec: GDNSpec, tp: int, rank: int) -> range:
    """Global GDN key-head indices held by `rank`; its value heads follow them (GVA groups)."""
    _check_rank(tp, rank)
    per = shard_layer(spec, tp).num_k_heads
    return range(rank * per, (rank + 1) * per)


def _check_rank(tp: int, rank: int) -> None:
    _positive("tp", tp)
    if not isinstance(rank, int) or not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank!r}")
