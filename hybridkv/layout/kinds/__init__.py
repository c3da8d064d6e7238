"""Layer kinds: the registry. Each :class:`LayerKind` member names the spec class that holds its facts.

A kind's facts (bytes per page, what a request holds of it, how it shards under TP,
which pieces arrive separately, what sits in its pages, what engines cut it into)
live on one frozen spec class per kind, a subclass of :class:`~hybridkv.layout.kinds.base.LayerSpec`;
everything else in hybridkv asks the spec and never compares kinds. Adding a kind is
its spec module beside these and one member below (``docs/design.md``, "Extending").
"""

from __future__ import annotations

import enum
import importlib
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridkv.layout.kinds.base import LayerSpec


class LayerKind(enum.Enum):
    """A layer's cache kind: (value, spec class as ``module:Class`` in this package, HF ``layer_types`` name).

    Append only: the handshake's layout tables carry a kind as its position here
    (``hybridkv/transport/memory.py``). The spec class is imported on first use,
    so this module imports none of them (and they can import it).
    """

    FULL_ATTENTION = ("full_attention", "attention:AttentionSpec", "full_attention")
    SLIDING_WINDOW = ("sliding_window", "attention:AttentionSpec", "sliding_attention")
    GDN = ("gdn", "gdn:GDNSpec", "linear_attention")
    CHUNKED_LOCAL = ("chunked_local", "attention:AttentionSpec", "chunked_attention")
    MAMBA = ("mamba", "state:StateSpec", "mamba")

    hf_layer_type: str

    def __new__(cls, value: str, spec: str, hf_layer_type: str) -> LayerKind:
        member = object.__new__(cls)
        member._value_ = value
        member._spec = spec  # type: ignore[attr-defined]
        member.hf_layer_type = hf_layer_type
        return member

    @property
    def spec_class(self) -> type[LayerSpec]:
        """The spec class holding this kind's facts."""
        return _spec_class(self._spec)  # type: ignore[attr-defined]


@cache
def _spec_class(path: str) -> type[LayerSpec]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = ["LayerKind"]
