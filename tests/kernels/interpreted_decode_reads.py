"""Run by test_gdn_interpreted.py in a subprocess: which bytes of the slot pool each decode kernel reads and writes, in
Triton's CPU interpreter (TRITON_INTERPRET=1, set before Triton is imported). The interpreter's load and store are
wrapped to record every address a load or store touches where its mask holds. Prints one JSON object: per kernel and
config, how many elements of the pool were read (and written) other than once among the live slots' state of the decoded
layer, and how many outside it (the other layer, unused slots, the pads' slot 0 under `tl.maximum(slot, 0)`); and for
the L2 prefetches of `triton_decode_prefetch` (recorded by `interpreter_patches`), how many elements were asked for
other than once each for the live rows a program reaches after its first two blocks, and how many in all.

A prefetch past a program's last block would read the next head's rows a second time, or the next slot's first rows,
and show here, while the outputs and the pool, which such a read does not change, stay right. The TMA walk's descriptor
loads and stores reach the same native load and store in the interpreter (as masked accesses of the box), so it is
covered too.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

import interpreter_patches  # noqa: E402, F401  (beside this script: the interpreter's numpy-2 faults)


class _Recorder:
    """The interpreter's native load/store, with the addresses under a true mask kept."""

    def __init__(self, native):
        self.native = native
        self.reads: list[np.ndarray] = []
        self.writes: list[np.ndarray] = []

    def __getattr__(self, name):
        return getattr(self.native, name)

    def load(self, ptrs, mask, other, dtype):
        self.reads.append(np.asarray(ptrs)[np.asarray(mask, dtype=bool)].ravel().copy())
        return self.native.load(ptrs, mask, other, dtype)

    def store(self, ptrs, value, mask):
        self.writes.append(np.asarray(ptrs)[np.asarray(mask, dtype=bool)].ravel().copy())
        return self.native.store(ptrs, value, mask)


_recorder = _Recorder(interpreter._interpreter)
interpreter._interpreter = _recorder

from hybridkv.kernels.gdn import decode_prefetch as triton_decode_prefetch
from hybridkv.kernels.gdn import decode_rows as triton_decode_rows
from hybridkv.kernels.gdn import decode_tma as triton_decode_tma
from hybridkv.kernels.gdn import fused_recurrent as triton_recurrent
from hybridkv.kernels.gdn import decode_kernels


def _l2_addresses(pool: torch.Tensor) -> list[np.ndarray]:
    """Every byte address of each L2 prefetch issued (`interpreter_patches.l2_prefetches`), one per pool element."""
    size = pool.element_size()
    return [np.arange(a, a + n, size, dtype=np.int64) for a, n in interpreter_patches.l2_prefetches]


def _want_l2(cfg: tuple, want: np.ndarray, slots: int, HV: int, V: int, K: int) -> np.ndarray:
    """For a prefetching config with L2AHEAD: each live element of the decoded layer asked into L2 once, but for the
    first two blocks of each program (those go straight into registers); without: none."""
    if not triton_decode_prefetch.l2_ahead(cfg):
        return np.zeros_like(want)
    rows = min(cfg[1], V)
    bv = min(cfg[0], rows)
    late = (np.arange(V) % rows) >= 2 * bv  # a row's place in its program's walk
    return want * np.broadcast_to(late[None, None, None, :, None], (slots, 2, HV, V, K)).reshape(-1)


def _counts(addresses: list[np.ndarray], pool: torch.Tensor) -> np.ndarray:
    """How often each element of ``pool`` (contiguous) was touched."""
    base, size = pool.data_ptr(), pool.element_size()
    flat = np.concatenate(addresses) if addresses else np.zeros(0, dtype=np.uint64)
    flat = flat.astype(np.int64) - base
    inside = (flat >= 0) & (flat < pool.numel() * size)
    return np.bincount(flat[inside] // size, minlength=pool.numel())


# Beside the shipped configs, at the test's small heads (K 32, V 64).
EXTRA_PREFETCH = ((8, 8, 1), (16, 32, 2), (8, 64, 1, 3), (16, 32, 2, 3))


def main() -> int:
    torch.manual_seed(0)
    N, H, HV, K, V, slots = 5, 2, 4, 32, 64, 9
    q, k = torch.randn(N, H, K).bfloat16(), torch.randn(N, H, K).bfloat16()
    v = torch.randn(N, HV, V).bfloat16()
    a, b = torch.randn(N, HV), torch.randn(N, HV)
    A_log, dt_bias = torch.randn(HV) * 0.5, torch.randn(HV) * 0.5
    # Slot 8 is the pool's last: a read past its last head's last block would leave the allocation.
    idx = torch.tensor([3, -1, 0, 8, 5])
    want = torch.zeros(slots, 2, HV, V, K, dtype=torch.int64)
    want[idx[idx >= 0], 1] = 1  # the decoded layer (1) of the live slots, once each
    want = want.reshape(-1).numpy()
    launches = {f"tile {cfg}": lambda *x, cfg=cfg: decode_kernels._launch_tile(
        cfg, *x, K**-0.5, True, True, 1.0, 20.0) for cfg in ((32, 4), (64, 8))}
    launches |= {f"rows {cfg}": lambda *x, cfg=cfg: triton_decode_rows.launch(cfg, *x, K**-0.5, True, 1.0, 20.0)
                 for cfg in triton_decode_rows.ROWS_CONFIGS}
    # (8, 8, 1): one block a program, nothing to prefetch after it; (16, 32, 2): two; with L2AHEAD, (8, 64, 1, 3):
    # eight blocks, six asked into L2; (16, 32, 2, 3): none.
    prefetch_cfgs = (*triton_decode_prefetch.PREFETCH_CONFIGS, *EXTRA_PREFETCH)
    launches |= {f"prefetch {cfg}": lambda *x, cfg=cfg: triton_decode_prefetch.launch(
        cfg, *x, K**-0.5, True, 1.0, 20.0) for cfg in prefetch_cfgs}
    want_l2 = {f"prefetch {cfg}": _want_l2(cfg, want, slots, HV, V, K) for cfg in prefetch_cfgs}
    # The TMA walk's descriptor loads reach the same native load in the interpreter. Three "SMs": a walk that wraps.
    launches |= {f"tma {cfg}": lambda *x, cfg=cfg: triton_decode_tma.launch(cfg, *x, K**-0.5, True, 1.0, 20.0, sms=3)
                 for cfg in triton_decode_tma.TMA_CONFIGS}
    out = {}
    for name, launch in launches.items():
        pool = (torch.randn(slots, 2, HV, V, K) * 0.1).bfloat16()
        o = torch.empty_like(v)
        _recorder.reads.clear()
        _recorder.writes.clear()
        interpreter_patches.l2_prefetches.clear()
        launch(q, k, v, a, b, A_log, dt_bias, o, pool[:, 1], idx)
        for what, addresses in (("reads", _recorder.reads), ("writes", _recorder.writes)):
            got = _counts(addresses, pool)
            out[f"{name}/{what}"] = [int(((got != 1) & (want == 1)).sum()), int(((got != 0) & (want == 0)).sum())]
        # L2 prefetches: [elements asked for other than as `_want_l2` says, how many were asked for].
        got = _counts(_l2_addresses(pool), pool)
        expect = want_l2.get(name, np.zeros_like(want))
        out[f"{name}/l2"] = [int((got != expect).sum()), int(got.sum())]
    print(json.dumps({"counts": out, "prefetch": {f"prefetch {cfg}": list(cfg) for cfg in prefetch_cfgs}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
