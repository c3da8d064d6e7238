"""The gather as indexing over strided views: what the staging copier ran before the Triton kernel (torch on a
GPU, numpy on the host), kept as the kernel's oracle and as the path where Triton is missing or switched off."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hybridkv.kernels.staging.rows import RowCopy

#: element types by width, for :func:`rows_view`
_NP_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def rows_view(buf: Any, offset: int, stride: int, rows: int, length: int, word: int = 1) -> Any:
    """``rows`` rows of ``length`` bytes, ``stride`` apart from byte ``offset`` of the flat byte buffer ``buf``
    (numpy or torch), as elements of ``word`` bytes (``length``, ``offset``, ``stride`` and the buffer's
    address multiples of it). The caller checked the bounds."""
    if hasattr(buf, "data_ptr"):
        import torch

        view = buf.as_strided((rows, length), (stride, 1), offset)
        return view if word == 1 else view.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[word])
    return np.ndarray(shape=(rows, length // word), dtype=_NP_WORDS[word], buffer=buf, offset=offset,
                      strides=(stride, word))


def _views(c: RowCopy) -> tuple[Any, Any]:
    return (rows_view(c.src, c.src_offset, c.src_stride, int(c.src_rows.max()) + 1, c.length, c.word),
            rows_view(c.dst, c.dst_offset, c.dst_stride, int(c.dst_rows.max()) + 1, c.length, c.word))


def gather_rows_reference(copies: Sequence[RowCopy]) -> None:
    """Run every copy as ``dst[dst_rows] = src[src_rows]`` over word-wide views, in order. torch buffers: every
    copy's row indices go to the device in one copy (one per copy, two blocking copies each, cost more than the
    gathers themselves at a few dozen copies). Returns without waiting for a device."""
    copies = [c for c in copies if c.src_rows.size]
    if not copies:
        return
    if not hasattr(copies[0].src, "data_ptr"):
        for c in copies:
            src, dst = _views(c)
            dst[c.dst_rows] = src[c.src_rows]
        return
    import torch

    flat = np.concatenate([a for c in copies for a in (c.src_rows, c.dst_rows)]).astype(np.int64, copy=False)
    index = torch.as_tensor(flat, device=copies[0].src.device)
    at = 0
    for c in copies:
        src, dst = _views(c)
        n = c.src_rows.size
        dst[index[at + n:at + 2 * n]] = src[index[at:at + n]]
        at += 2 * n
