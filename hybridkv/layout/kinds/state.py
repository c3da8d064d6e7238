"""A recurrent state kept as one page of tensors (Mamba, Mamba2, short conv, ...), moved whole.

GDN has its own spec (``gdn.py``) because hybridkv knows which bytes of its state
are which head, so different TP sizes can pair. Any other state an engine declares
(vLLM's ``MambaSpec``: a list of per-rank shapes and dtypes) is this spec: the
tensors back to back in one page, each one field. Their head structure is not
known here, so a state moves only between sides of the TP size it was taken at
(``taken_tp``), unless every rank holds all of it (``replicated``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

from hybridkv.layout.fields import Field, FieldKind, PageContent
from hybridkv.layout.kinds import LayerKind
from hybridkv.layout.kinds.base import ComponentKind, DType, LayerSpec, Paging, check_rank, positive


@dataclass(frozen=True, kw_only=True)
class StateSpec(LayerSpec):
    """One TP rank's state tensors (`shapes`, `state_dtypes`) as the engine holds them at `taken_tp`."""

    shapes: tuple[tuple[int, ...], ...]
    state_dtypes: tuple[DType, ...]
    taken_tp: int = 1
    replicated: bool = False
    #: what the engine calls the state (vLLM's mamba_type: "mamba2", "short_conv", ...)
    family: str = "mamba"
    #: every tensor's first dimension splits evenly across TP ranks (Mamba2 heads and conv channels, for
    #: offline analysis from a TP-1 spec); a rank's share is still moved whole, between equal TP sizes
    splits: bool = False

    kind: ClassVar[LayerKind] = LayerKind.MAMBA
    paging: ClassVar[Paging] = Paging.STATE
    components: ClassVar[tuple[ComponentKind, ...]] = (ComponentKind.STATE,)
    engine_tensors: ClassVar[int] = 2  # conv and SSM, as most engines keep them
    page_sub_reads: ClassVar[int] = 1

    def __post_init__(self) -> None:
        if not self.shapes or len(self.shapes) != len(self.state_dtypes):
            raise ValueError(f"a state needs one dtype per tensor, got shapes {self.shapes} and dtypes "
                             f"{self.state_dtypes}")
        for shape in self.shapes:
            if not shape or any(not isinstance(d, int) or d <= 0 for d in shape):
                raise ValueError(f"state tensor shape {shape} must be positive ints")
        positive("taken_tp", self.taken_tp)

    @property
    def tensor_bytes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.state_dtypes))

    @property
    def state_bytes(self) -> int:
        return sum(self.tensor_bytes)

    @property
    def dtypes(self) -> tuple[DType, ...]:
        return self.state_dtypes

    def page_bytes(self, block_size: int) -> int:
        return self.state_bytes

    def shard(self, tp: int) -> StateSpec:
        positive("tp", tp)
        if self.splits and self.taken_tp == 1 and tp > 1 and not self.replicated:
            if any(s[0] % tp for s in self.shapes):
                raise ValueError(f"a {self.family} state of shapes {self.shapes} does not split across TP {tp}")
            return replace(self, shapes=tuple((s[0] // tp, *s[1:]) for s in self.shapes), taken_tp=tp)
        if not self.replicated and tp != self.taken_tp:
            raise ValueError(f"a {self.family} state taken at TP {self.taken_tp} moves only between TP "
                             f"{self.taken_tp} sides (hybridkv does not know its heads), not at TP {tp}")
        return self

    def _slot(self, tp: int, rank: int) -> int:
        check_rank(tp, rank)
        self.shard(tp)
        return 0 if self.replicated else rank * len(self.shapes)

    def page_fields(self, layer: int, *, tp: int, rank: int, block_tokens: int | None,
                    content: PageContent | None) -> tuple[Field, ...]:
        slot, at, out = self._slot(tp, rank), 0, []
        for i, n in enumerate(self.tensor_bytes):
            out.append(Field(key=(FieldKind.STATE, layer, slot + i), offset=at, nbytes=n))
            at += n
        return tuple(out)

    def planned_fields(self, layers: tuple[int, ...], *, tp: int, rank: int,
                       block_size: int) -> tuple[tuple[Field, ...], int]:
        slot, at, out = self._slot(tp, rank), 0, []
        for layer in layers:
            for i, n in enumerate(self.tensor_bytes):
                out.append(Field(key=(FieldKind.STATE, layer, slot + i), offset=at, nbytes=n))
                at += n
        return tuple(out), at
