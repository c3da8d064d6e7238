"""The physical ceiling of `hybridkv bench transfer` (d): the request's bytes as one plain copy."""

from __future__ import annotations

import statistics
import time


def _copy_ceiling(nbytes: int, devices: tuple[int, int] | None, iters: int) -> dict:
    """The same bytes copied once per iteration: GPU producer -> GPU consumer with torch, else host memcpy."""
    reps = max(iters, 5)
    if devices is None:
        import numpy as np

        src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        ts = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            ts.append(time.perf_counter() - t0)
        return {"copy_s": statistics.median(ts[1:]), "copy_kind": "numpy memcpy (host)", "peer_access": None}
    import torch

    p, c = devices
    src = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{p}")
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{c}")
    stream = torch.cuda.current_stream(c)  # torch makes the consumer's stream wait for a cross-device copy
    ts = []
    for i in range(reps + 1):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(c):
            t0.record(stream)
            dst.copy_(src)
            t1.record(stream)
        t1.synchronize()
        ts.append(t0.elapsed_time(t1) / 1e3)
    if not torch.equal(dst[: 1 << 20], src[: 1 << 20].to(dst.device)):
        raise RuntimeError("the device copy ceiling did not copy")
    return {"copy_s": statistics.median(ts[1:]), "copy_kind": f"torch copy_ cuda:{p} -> cuda:{c}",
            "peer_access": bool(p == c or torch.cuda.can_device_access_peer(c, p))}
