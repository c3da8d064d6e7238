"""Programmatic dependent launch (PDL) between the kernels of one call.

A kernel launched with PDL (`launch_pdl=True`) on Hopper may be placed on the SMs while the kernel before it in the
stream is still finishing, instead of after it has drained; `wait` (griddepcontrol.wait), the first thing such a
kernel does, blocks until that kernel has completed and its writes are visible. So the launch latency and the
previous kernel's tail overlap, and nothing is read or written early. Only launches after a call's first kernel use
it: the first waits in full for whatever the caller queued before it (the previous layer's output).
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # a Triton without it (older than 3.4) launches plainly: `enabled` says no
    gdc_wait = None

# Off: every launch waits for the previous kernel to drain, as a plain launch does (a probe's A/B switch).
ENABLED = True


def enabled(device) -> bool:
    """Whether launches on ``device`` (a torch device) use PDL: a Hopper or later GPU, and `ENABLED`."""
    if not (ENABLED and gdc_wait is not None and device.type == "cuda"):
        return False
    if device.index is None:  # a tensor's device always names one; a bare torch.device("cuda") may not
        import torch

        return _major(torch.cuda.current_device()) >= 9
    return _major(device.index) >= 9


@functools.cache
def _major(index: int) -> int:
    # Asked on every chunked call; the device's answer does not change.
    import torch

    return torch.cuda.get_device_capability(index)[0]


def launch_kwargs(on: bool) -> dict:
    """What a launch of a kernel taking PDL (and calling `wait` with it) passes: the kernel's constexpr and Triton's
    launch option, or nothing (a plain launch)."""
    return {"PDL": True, "launch_pdl": True} if on else {}


@triton.jit
def wait(PDL: tl.constexpr):
    """The first statement of a kernel that may be launched with PDL: without it (PDL False) nothing."""
    if PDL:
        gdc_wait()
