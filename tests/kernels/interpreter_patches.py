"""Triton 3.6's interpreter has two numpy-2 faults that the GDN kernels hit, patched on import (test-only): a bf16 tl.dot
multiplies the raw uint16 bit patterns, and a one-element array used as a loop bound fails int(). Neither touches
compiled kernels. Imported by the interpreter scripts (interpreted_*.py) after TRITON_INTERPRET=1 is set."""

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


interpreter.InterpreterBuilder.create_dot = _create_dot
interpreter._patch_lang_tensor = _patch_lang_tensor
