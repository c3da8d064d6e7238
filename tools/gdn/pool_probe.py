"""Device probe: the decode tuner's pick in engine-shaped slot pools, tuned as it ships (in the caller's pool, at its
slots and pads) against the pick it made before (on a dense scratch pool of N slots, slots 0..N-1), both timed in the
engine pool as `bench gdn` times a step. Prints one line per (pool, shape, batch, state dtype) and the JSON.

    python -m tools.gdn.pool_probe [--iters 20] [--pool vllm --pool sglang] [--json PATH]

Run from the repository root on a CUDA machine (hybridkv installed, or on PYTHONPATH with benchmarks/ installed as
hybridkv.benchmarks).
"""

from __future__ import annotations

import argparse
import json

import torch

from hybridkv.benchmarks.gdn import cases
from hybridkv.benchmarks.gdn.timing import _copy_gbps, _median_ms
from hybridkv.kernels.gdn import decode, decode_kernels, decode_rows, decode_tma, decode_tune

D = cases.D


def _dense_pick(args, v_first=True):
    """The former tuner: every candidate timed on a dense scratch pool of the step's rows, slots 0..N-1, no pads."""
    q, k, v, a, b, A_log, dt_bias, o, pool, idx, *rest = args
    rows = idx.numel()
    scratch = torch.zeros((rows, *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    ident = torch.arange(rows, device=q.device, dtype=idx.dtype)
    sub = (q, k, v, a, b, A_log, dt_bias, o, scratch, ident, *rest)
    tma = decode_tma.eligible(q, v, scratch, v_first)
    by_rows = decode_rows.eligible(q, v, scratch, v_first)
    return decode_tune.tune(sub, tma=tma, by_rows=by_rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20, help="timed calls per measurement (median)")
    p.add_argument("--pool", action="append", default=None, choices=[x.value for x in cases.Pool],
                   help="pools to run in (repeatable; default: vllm and sglang)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows there")
    a = p.parse_args()
    pools = [cases.Pool(x) for x in (a.pool or cases.ENGINE_POOLS)]
    copy = _copy_gbps(a.iters)
    print(f"{torch.cuda.get_device_name()}; device copy {copy:.0f} GB/s", flush=True)
    out = []
    for pool_kind in pools:
        for model, H, HV in cases.DECODE_SHAPES:
            for N in cases.DECODE_BATCHES:
                for dtype in (torch.float32, torch.bfloat16):
                    step = cases.decode_step(pool_kind, N, "cuda")
                    R = step.indices.numel()
                    q, k, v, ga, gb, A_log, dt_bias = cases.decode_inputs(R, H, HV, "cuda")
                    pool = cases.decode_pool(step.slots, HV, dtype, "cuda")
                    o = torch.empty_like(v)
                    args = (q, k, v, ga, gb, A_log, dt_bias, o, pool, step.indices, D**-0.5, True, True, 1.0, 20.0)
                    picks = {"in pool": decode_tune.tune(args, tma=decode_tma.eligible(q, v, pool, True),
                                                         by_rows=decode_rows.eligible(q, v, pool, True)),
                             "dense scratch": _dense_pick(args)}
                    state_bytes = N * HV * D * D * 2 * pool.element_size()
                    row = {"pool": pool_kind.value, "model": model, "HV": HV, "N": N,
                           "dtype": str(dtype).removeprefix("torch.")}
                    for name, choice in picks.items():
                        ms = _median_ms(lambda c=choice: decode_kernels.launch(c, *args), a.iters)
                        row[name] = {"choice": str(choice), "ms": ms, "copy_pct": 100 * state_bytes / ms / 1e6 / copy}
                    out.append(row)
                    print(f"{row['pool']:6} {model:4} B={N:3} {row['dtype']:8} "
                          + "  ".join(f"{n}: {row[n]['choice']:24} {row[n]['copy_pct']:5.1f}%" for n in picks),
                          flush=True)
                    del pool
    print("decode keys:", {str(k): str(c) for k, c in decode.decode_choices().items()})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
