"""Device probe: the Gluon kernels as they are against an earlier copy of them, in one run, on the bench's prefill
shapes through the plain call (each shape's own plan), with each kernel's device time (torch.profiler) and every
variant's error against the fp32 reference.

    python -m tools.gdn.ab_probe --before DIR [--iters 10] [--json PATH] [--shapes 4x8192]

DIR holds the earlier `gluon_chunk_inverse.py` and `gluon_chunk_chain.py` (say, from `git show REV:path`, in a folder
git does not ignore, so that it travels to the device); they are loaded as modules of their own and swapped in for the
shipped ones' `launch`. Where a run also timed a third variant (a keyword of the shipped `launch`), add it to
`variants`. Run from the repository root on a CUDA machine. Its first run: tools/device/results/
ab_gram_barriers_h200.txt.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import torch

from hybridkv.kernels.gdn import api, bench_timing, breakdown, gluon_chunk_chain, gluon_chunk_inverse

from tools.gdn.schedules import reference_cases, rel


def _load(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def variants(before: pathlib.Path) -> dict[str, tuple]:
    """name -> (inverse launch, chain launch)."""
    old_inv = _load(before / "gluon_chunk_inverse.py", "before_gluon_chunk_inverse")
    old_chain = _load(before / "gluon_chunk_chain.py", "before_gluon_chunk_chain")
    new_inv, new_chain = gluon_chunk_inverse.launch, gluon_chunk_chain.launch
    return {
        "before": (old_inv.launch, old_chain.launch),
        "now": (new_inv, new_chain),
    }


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=pathlib.Path, required=True)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--shapes", nargs="*", default=[])
    a = p.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    table = variants(a.before)
    real = gluon_chunk_inverse.launch, gluon_chunk_chain.launch
    rows = []
    try:
        for shape, args, kw, o_ref, s_ref in reference_cases(a.shapes):
            q, k, v, g, beta = args
            for name, (inv, chain) in table.items():
                gluon_chunk_inverse.launch, gluon_chunk_chain.launch = inv, chain

                def call():
                    return api.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=kw["cu_seqlens"],  # noqa: B023
                                                      output_final_state=True, use_qk_l2norm_in_kernel=True)

                o, s = call()
                err = max(rel(o, o_ref), rel(s, s_ref))
                b = breakdown.measure(name, call, a.iters, bench_timing._median_ms)
                kernels = {k_: round(us, 1) for k_, us in b.kernels}
                rows.append(dict(shape=shape, variant=name, call_us=b.call_us, kernels=kernels, err=err))
                top = "  ".join(f"{k_} {us:.1f}" for k_, us in list(kernels.items())[:3])
                print(f"{shape:32} {name:20} call {b.call_us:7.1f} us  err {err:.2e}  {top}", flush=True)
    finally:
        gluon_chunk_inverse.launch, gluon_chunk_chain.launch = real
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
