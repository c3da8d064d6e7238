"""What every layer kind's spec knows about itself, and the small enums those facts are made of.

A spec class is a frozen, keyword-only dataclass subclassing :class:`LayerSpec`. Its
fields are what a model (or an engine's own spec, e.g. vLLM's ``KVCacheSpec``) says
about one layer; the facts below follow from them. Callers ask these and never
compare :class:`~hybridkv.layout.kinds.LayerKind` members, so a new kind flows
through grouping, layouts, fencing and the descriptor analyzer without edits there.
"""

from __future__ import annotations

import abc
import enum
import math
from typing import TYPE_CHECKING, ClassVar, Self

if TYPE_CHECKING:
    from hybridkv.layout.fields import Field, PageContent
    from hybridkv.layout.kinds import LayerKind


class DType(enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT8_E4M3 = "float8_e4m3"
    FLOAT8_E5M2 = "float8_e5m2"
    # Storage types of quantized KV caches (vLLM keeps fp8/int8/nvfp4 caches as bytes; what the bytes
    # mean is the spec's `encoding`, e.g. vLLM's kv-cache dtype name).
    UINT8 = "uint8"
    INT8 = "int8"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @classmethod
    def parse(cls, value: str | DType, *, what: str = "dtype") -> DType:
        if isinstance(value, DType):
            return value
        aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                   "float": "float32", "fp8": "float8_e4m3", "float8_e4m3fn": "float8_e4m3",
                   "fp8_e4m3": "float8_e4m3", "fp8_e5m2": "float8_e5m2"}
        name = aliases.get(str(value).lower(), str(value).lower())
        try:
            return cls(name)
        except ValueError:
            choices = ", ".join(d.value for d in cls)
            raise ValueError(f"{what} {value!r} is not one of: {choices}") from None


_ITEMSIZE = {DType.FLOAT32: 4, DType.BFLOAT16: 2, DType.FLOAT16: 2, DType.FLOAT8_E4M3: 1, DType.FLOAT8_E5M2: 1,
             DType.UINT8: 1, DType.INT8: 1}


class Paging(enum.Enum):
    """What one block of a kind holds (vLLM: AttentionSpec vs MambaSpec)."""

    TOKENS = "tokens"  # block_size tokens; a request holds one block per block_size tokens (KV)
    STATE = "state"    # one request's whole recurrent state; a request holds one block (GDN, Mamba)


class ComponentKind(enum.Enum):
    """A separately-arriving piece of a group's cache (fencing rule 4 waits for all of them)."""

    KV = "kv"
    CONV = "conv"
    SSM = "ssm"
    STATE = "state"  # a recurrent state an engine moves as one piece (Mamba/Mamba2/short-conv pages)


class LayerSpec(abc.ABC):
    """One layer kind's spec. Subclasses are frozen kw-only dataclasses; uniform per kind in a model."""

    #: What one block holds.
    paging: ClassVar[Paging]
    #: Pieces engines move as separate transfers; a request is complete when all have landed.
    components: ClassVar[tuple[ComponentKind, ...]]
    #: Tensors an engine keeps per layer when it does not pack them (K and V; conv and SSM state):
    #: what vLLM before HMA, SGLang and Mooncake register, one descriptor each (the analyzer's models).
    engine_tensors: ClassVar[int]
    #: Reads vLLM 0.33 issues for one layer's page (packed K|V: 1; GDN: conv Q, K, V runs + SSM).
    page_sub_reads: ClassVar[int]

    @property
    @abc.abstractmethod
    def kind(self) -> LayerKind: ...

    @property
    def window(self) -> int | None:
        """Tokens a request keeps of this kind (sliding window); None: all of them."""
        return None

    @property
    @abc.abstractmethod
    def dtypes(self) -> tuple[DType, ...]:
        """The element types of this kind's tensors (part of the peers' compatibility check)."""

    @abc.abstractmethod
    def page_bytes(self, block_size: int) -> int:
        """Bytes of one layer's block: linear in block_size for TOKENS kinds, the state for STATE kinds."""

    def block_tokens(self, block_size: int) -> int | None:
        """Tokens per block of a group of this kind; None for a state (one block = one request)."""
        return block_size if self.paging is Paging.TOKENS else None

    def blocks_for_tokens(self, tokens: int, block_size: int, *, clip_window: bool = True) -> int:
        """Blocks a request of `tokens` tokens holds (a window keeps cdiv(window, block) + 1)."""
        if self.paging is Paging.STATE:
            return 1
        blocks = math.ceil(tokens / block_size)
        if clip_window and self.window is not None:
            blocks = min(blocks, math.ceil(self.window / block_size) + 1)
        return blocks

    @abc.abstractmethod
    def shard(self, tp: int) -> Self:
        """The spec one rank holds at tensor parallelism `tp` (from the unsharded spec)."""

    def with_ssm_dtype(self, dtype: DType) -> Self | None:
        """This spec with its SSM state in `dtype`; None if the kind has no SSM state."""
        return None

    @abc.abstractmethod
    def page_fields(self, layer: int, *, tp: int, rank: int, block_tokens: int | None,
                    content: PageContent | None) -> tuple[Field, ...]:
        """Fields of one layer's page as an engine lays it out (adopting its tensors)."""

    def kernel_page_fields(self, layer: int, *, tp: int, rank: int, block_tokens: int | None,
                           kernel_tokens: int, content: PageContent | None) -> tuple[Field, ...]:
        """Fields of an engine page split into kernel blocks of `kernel_tokens` tokens (attention
        kernels smaller than the logical block). Only token kinds have kernel blocks."""
        raise ValueError(f"a {self.kind.value} layer's page ({layer}) is not split into kernel blocks")

    def engine_content(self, *, head_outer: bool) -> PageContent | None:
        """Which of this kind's page arrangements an engine uses (`head_outer`: its KV layout puts heads
        outside tokens); None for a kind with one arrangement, the one `page_fields` describes."""
        return None

    @abc.abstractmethod
    def planned_fields(self, layers: tuple[int, ...], *, tp: int, rank: int,
                       block_size: int) -> tuple[tuple[Field, ...], int]:
        """Fields and bytes of one block of all `layers` in hybridkv's planned layout, where a
        rank's share (a TP shard) is one contiguous run: (fields, page bytes)."""


def positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_rank(tp: int, rank: int) -> None:
    positive("tp", tp)
    if not isinstance(rank, int) or not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank!r}")
