"""Memory for planned layouts, behind one small interface.

numpy on the CPU, torch on a device, and a virtual allocator that hands out
addresses without memory (the analyzer plans real layouts of 400B-parameter
models without allocating them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol


class MemKind(enum.Enum):
    DRAM = "DRAM"
    VRAM = "VRAM"


@dataclass(frozen=True, kw_only=True)
class Allocation:
    addr: int
    nbytes: int
    mem: MemKind
    device_id: int
    owner: Any = field(default=None, compare=False, repr=False)  # keeps the memory alive


class Allocator(Protocol):
    mem: MemKind
    device_id: int

    def allocate(self, nbytes: int) -> Allocation: ...


PAGE_ALIGN = 4096


class NumpyAllocator:
    """Zeroed, page-aligned host memory."""

    mem = MemKind.DRAM

    def __init__(self) -> None:
        self.device_id = 0

    def allocate(self, nbytes: int) -> Allocation:
        import numpy as np

        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        raw = np.zeros(nbytes + PAGE_ALIGN, dtype=np.uint8)
        skip = (-raw.ctypes.data) % PAGE_ALIGN
        buf = raw[skip : skip + nbytes]
        return Allocation(addr=buf.ctypes.data, nbytes=nbytes, mem=self.mem, device_id=0, owner=buf)


class TorchAllocator:
    """Zeroed memory from torch on `device` (e.g. "cuda:0" or "cpu")."""

    def __init__(self, device: str = "cuda:0") -> None:
        import torch

        self._device = torch.device(device)
        self.mem = MemKind.VRAM if self._device.type == "cuda" else MemKind.DRAM
        self.device_id = self._device.index or 0

    def allocate(self, nbytes: int) -> Allocation:
        import torch

        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=self._device)
        return Allocation(addr=buf.data_ptr(), nbytes=nbytes, mem=self.mem, device_id=self.device_id, owner=buf)


class VirtualAllocator:
    """Addresses without memory, for counting and planning only. Never read or write them."""

    def __init__(self, *, base: int = 1 << 40, mem: MemKind = MemKind.VRAM, device_id: int = 0) -> None:
        self._next = base
        self.mem = mem
        self.device_id = device_id

    def allocate(self, nbytes: int) -> Allocation:
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        addr = self._next
        # A gap between allocations, so nothing is adjacent by accident.
        self._next += -(-(nbytes + PAGE_ALIGN) // PAGE_ALIGN) * PAGE_ALIGN + PAGE_ALIGN
        return Allocation(addr=addr, nbytes=nbytes, mem=self.mem, device_id=self.device_id)
