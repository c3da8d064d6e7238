"""The staging copier's gather: many rows of one byte buffer to rows of another, in one pass.

`rows` holds what a gather is (:class:`RowCopy`) and the per-row table a launch reads (numpy only);
`reference` (``gather_rows_reference``) the torch (or numpy) indexing the copier ran before the kernel, also
the oracle; `gather` (``gather_rows``) the Triton kernel (imports torch and Triton).
``hybridkv.transport.staging.Copier`` builds the row copies, checks their bounds, and runs one or the other.
docs/kernels.md describes them.

Names resolve lazily, so importing this package imports neither torch nor Triton.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"RowCopy": "rows", "row_table": "rows", "RowTable": "rows", "gather_rows_reference": "reference",
          "rows_view": "reference", "gather_rows": "gather", "table_of": "rows",
          "gather_table": "gather"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
