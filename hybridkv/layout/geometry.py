"""What a hybrid model's caches are: a sequence of layers, each with its kind's spec, and TP sharding.

Every spec computes its own bytes (``hybridkv.layout.kinds``: one spec class per
kind). Nothing here knows about pages, blocks or engines: that is `hma`
(grouping) and `layout` (where bytes live).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybridkv.layout.kinds import LayerKind
from hybridkv.layout.kinds.attention import AttentionSpec, kv_heads_of_rank
from hybridkv.layout.kinds.base import ComponentKind, DType, LayerSpec, Paging, positive
from hybridkv.layout.kinds.gdn import ConvLayout, GDNSpec, k_heads_of_rank
from hybridkv.layout.kinds.state import StateSpec


@dataclass(frozen=True, kw_only=True)
class ModelGeometry:
    """A model's cache-bearing layers in order. `tp` is the sharding this geometry describes."""

    name: str
    layers: tuple[LayerSpec, ...]
    tp: int = 1

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"model {self.name!r} has no layers")
        positive("tp", self.tp)

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

    def specs(self) -> tuple[LayerSpec, ...]:
        """One spec per kind present, in first-appearance order."""
        return tuple(self.spec_of(k) for k in self.kinds())

    @property
    def has_ssm_state(self) -> bool:
        return any(s.with_ssm_dtype(DType.FLOAT32) is not None for s in self.layers)

    def with_ssm_dtype(self, dtype: DType) -> ModelGeometry:
        return replace(self, layers=tuple(s.with_ssm_dtype(dtype) or s for s in self.layers))

    def shard(self, tp: int) -> ModelGeometry:
        """The per-rank geometry at tensor parallelism `tp` (from an unsharded geometry)."""
        if self.tp != 1:
            raise ValueError(f"shard() takes an unsharded geometry, this one is already at tp={self.tp}")
        positive("tp", tp)
        return replace(self, layers=tuple(s.shard(tp) for s in self.layers), tp=tp)


def shard_layer(spec: LayerSpec, tp: int) -> LayerSpec:
    return spec.shard(tp)


__all__ = [
    "AttentionSpec", "ComponentKind", "ConvLayout", "DType", "GDNSpec", "LayerKind", "LayerSpec", "ModelGeometry",
    "Paging", "StateSpec", "k_heads_of_rank", "kv_heads_of_rank", "shard_layer",
]
