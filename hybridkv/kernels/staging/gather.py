"""Triton gather of many rows between byte buffers on one GPU: the staging copier's pack and unpack.

Oracle: `reference.gather_rows_reference` (indexing over strided views, 26-84 GB/s on an H100 against ~1,300 GB/s
for a plain copy: torch's index kernels, not the element width, bound it). Here each program copies one tile
of one row, addresses read from a per-row table (`rows.row_table`), so rows of every copy of a pack go in one
launch per (word, alignment) class. Elements are the copy's word; the table's alignment is told to the
compiler (`tl.multiple_of`), so rows aligned to 16 bytes move as 16-byte vectors. No atomics: rows of one
launch never overlap on the destination (a pack's pieces are disjoint), so programs are independent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hybridkv.kernels.staging.rows import RowCopy, RowTable, row_table

_ELEMENTS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
TILE_BYTES = 8192  # one program's tile: 64 bytes per thread at 4 warps, four 16-byte vectors
MAX_GRID_1 = 65535  # CUDA's limit on the grid's second dimension


@triton.jit
def _gather_rows(table, ELEMENT: tl.constexpr, WORD: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr,
                 TILES: tl.constexpr):
    """Grid (rows, cdiv(longest row, BLOCK * TILES)): program (r, c) copies elements
    [c * BLOCK * TILES, (c + 1) * BLOCK * TILES) of row r, masked to the row's length."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1).to(tl.int64) * (BLOCK * TILES)
    # the hint goes on the pointers (on the integers it is lost in the cast): 16-byte vectors where aligned
    src = tl.multiple_of(tl.load(table + row * 3).to(tl.pointer_type(ELEMENT)), ALIGN)
    dst = tl.multiple_of(tl.load(table + row * 3 + 1).to(tl.pointer_type(ELEMENT)), ALIGN)
    n = tl.multiple_of(tl.load(table + row * 3 + 2), ALIGN // WORD)  # whole vectors: the mask holds per vector
    for t in tl.static_range(TILES):
        o = first + t * BLOCK + tl.arange(0, BLOCK)
        m = o < n
        tl.store(dst + o, tl.load(src + o, mask=m), mask=m)


def launch_shape(word: int, max_words: int) -> tuple[int, int, int, int]:
    """(BLOCK elements, TILES per program, programs per row, warps) for rows of at most ``max_words``."""
    block = max(16, min(triton.next_power_of_2(max_words), TILE_BYTES // word))
    tiles = triton.cdiv(triton.cdiv(max_words, block), MAX_GRID_1)
    warps = max(1, min(4, block * word // 512))
    return block, tiles, triton.cdiv(max_words, block * tiles), warps


def gather_rows(copies: Sequence[RowCopy]) -> None:
    """Run every copy (bounds already checked by the caller) on its buffers' device, one launch per (word,
    alignment) class; returns without waiting for the device. Rows land in any order, so no two may overlap on
    the destination and none may read what another writes (a pack or unpack never does: slot and pages differ).
    Host buffers (numpy or torch) run only under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests)."""
    first = next((c.src for c in copies if c.src_rows.size), None)
    if first is not None:
        gather_table(row_table(copies), torch.device(getattr(first, "device", "cpu")))  # numpy 2 arrays say "cpu"


def gather_table(rows: RowTable, device: torch.device) -> None:
    """:func:`gather_rows` of a table already built (the staging copier builds it from its steps' columns)."""
    if not rows.launches:
        return
    table = torch.as_tensor(rows.table, device=device)  # one host-to-device copy for every row of the run
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for launch in rows.launches:
            block, tiles, programs, warps = launch_shape(launch.word, launch.max_words)
            _gather_rows[(launch.stop - launch.start, programs)](
                table[launch.start:launch.stop], ELEMENT=_ELEMENTS[launch.word], WORD=launch.word,
                ALIGN=launch.align, BLOCK=block, TILES=tiles, num_warps=warps)
