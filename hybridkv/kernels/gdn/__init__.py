"""Gated DeltaNet kernels: chunked prefill, fused recurrent/decode, causal conv1d.

`chunk_gated_delta_rule` and `fused_recurrent_gated_delta_rule` are drop-ins for FLA's functions of the same names.
`gated_delta_rule_decode` and the conv1d entries read and write state in place in slot pools, indexed by
`state_indices` (-1 = pad). Modules by stage: `chunk` (prefill, planned by `chunk_plan`, with `inverse`,
`chunk_scan` and the Hopper backend in `gluon/`), `fused_recurrent` and `decode*` (decode and its tuner), `conv`,
and `naive` (the torch references). docs/kernels.md describes them.

Names resolve lazily, so importing this package imports neither torch nor Triton.
"""

from __future__ import annotations

import importlib
from typing import Any

PAD_SLOT_ID = -1

_API = (
    "ConvActivation",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "gated_delta_rule_decode",
)

__all__ = ["PAD_SLOT_ID", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module("hybridkv.kernels.gdn.api"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
