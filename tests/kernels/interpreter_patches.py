"""Triton 3.6's interpreter has two numpy-2 faults that the GDN kernels hit, patched on import (test-only): a bf16 tl.dot
multiplies the raw uint16 bit patterns, and a one-element array used as a loop bound fails int(). Neither touches
compiled kernels. Imported by the interpreter scripts (interpreted_*.py) after TRITON_INTERPRET=1 is set.

The interpreter runs no inline asm. The one asm block the decode kernels use, `triton_decode_prefetch._l2_prefetch` (an
L2 prefetch, which changes nothing a program computes), is run here as a no-op that records its (address, bytes) in
`l2_prefetches`, so a test can check that it asks only for what the program itself reads."""

from __future__ import annotations

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

_dot = interpreter.InterpreterBuilder.create_dot


def _as_float(handle):
    if getattr(handle.dtype, "scalar", handle.dtype) == tl.bfloat16:
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
    return handle


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    return _dot(self, _as_float(a), _as_float(b), d, input_precision, max_num_imprecise_acc)


_patch_tensor = interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))


class _AsmResults:
    """What the interpreter's inline-asm call returns to `tl.inline_asm_elementwise`."""

    def __init__(self, handles):
        self._handles = handles

    def get_result(self, i):
        return self._handles[i]


# (address, bytes) of each L2 prefetch an interpreted kernel issued (`_create_inline_asm`).
l2_prefetches: list[tuple[int, int]] = []
_inline_asm = interpreter.InterpreterBuilder.create_inline_asm


def _create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
    from hybridkv.kernels.gdn.decode_prefetch import L2_PREFETCH

    if L2_PREFETCH not in asm:
        return _inline_asm(self, asm, constraints, values, types, is_pure, pack)
    address, nbytes = (np.asarray(h.data).reshape(-1) for h in values)
    if address.size != 1 or nbytes.size != 1:
        raise ValueError(f"an L2 prefetch takes one address and one size, got {address.size} and {nbytes.size}")
    l2_prefetches.append((int(address[0]), int(nbytes[0])))
    return _AsmResults([interpreter.TensorHandle(np.zeros(1, dtype=np.int32), tl.int32)])


interpreter.InterpreterBuilder.create_inline_asm = _create_inline_asm
interpreter.InterpreterBuilder.create_dot = _create_dot
interpreter._patch_lang_tensor = _patch_lang_tensor
