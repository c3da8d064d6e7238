"""Device probe: decode in a state pool as vLLM's hybrid allocator lays it out - each GDN layer's SSM state a strided
view into shared pages (the conv state first in the page, the page padded to the attention page, and with the
block-outermost layout every layer of the group in one block) - against the same slots in a contiguous pool.
Prints % of copy bandwidth and the tuner's pick for each. `bench gdn` times contiguous per-layer pools (SGLang's
MambaPool layout); this asks whether vLLM's views cost more.

    python -m tools.gdn.strided_pool_probe [--iters 20] [--layers 4]

Run from the repository root on a CUDA machine (hybridkv installed, or on PYTHONPATH with benchmarks/ installed as
hybridkv.benchmarks).
"""

from __future__ import annotations

import argparse

import torch

from hybridkv.benchmarks.gdn import cases
from hybridkv.benchmarks.gdn.timing import _copy_gbps, _median_ms
from hybridkv.kernels.gdn import decode, gated_delta_rule_decode

D = cases.D
CONV_KERNEL = 4


def _views(slots: int, H: int, HV: int, dtype, layers: int) -> dict[str, torch.Tensor]:
    """The SSM state of one layer, [slots, HV, V, K]: contiguous; a per-layer page (conv state, then SSM state, the
    page padded by 1/16); the block-outermost page holding `layers` layers' pages. Conv and SSM share the page's
    dtype here (a bf16-state page; fp32 pages keep the conv state in the same element size for simplicity)."""
    ssm = HV * D * D
    conv = (2 * H * D + HV * D) * (CONV_KERNEL - 1)
    page = ssm + conv
    page += -(-page // 16)  # the padding up to the attention page
    out = {"contiguous": cases.decode_pool(slots, HV, dtype, "cuda")}
    for name, per_block in (("page", 1), (f"{layers} layers a block", layers)):
        raw = torch.zeros(slots, per_block, page, device="cuda", dtype=dtype)
        layer = raw[:, per_block // 2]
        view = layer.as_strided((slots, HV, D, D), (per_block * page, D * D, D, 1), layer.storage_offset() + conv)
        view.copy_(out["contiguous"])
        out[name] = view
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20, help="timed calls per measurement (median; default 20)")
    p.add_argument("--layers", type=int, default=4, help="GDN layers a block holds, block-outermost (default 4)")
    a = p.parse_args()
    copy = _copy_gbps(a.iters)
    print(f"{torch.cuda.get_device_name()}; device copy {copy:.0f} GB/s", flush=True)
    for model, H, HV in cases.DECODE_SHAPES:
        for N in cases.DECODE_BATCHES:
            for dtype in (torch.float32, torch.bfloat16):
                step = cases.decode_step(cases.Pool.VLLM, N, "cuda")
                R = step.indices.numel()
                q, k, v, ga, gb, A_log, dt_bias = cases.decode_inputs(R, H, HV, "cuda")
                state_bytes = N * HV * D * D * 2 * torch.empty((), dtype=dtype).element_size()
                cells = []
                for name, pool in _views(step.slots, H, HV, dtype, a.layers).items():
                    before = set(decode.decode_choices())
                    ms = _median_ms(lambda: gated_delta_rule_decode(q, k, v, ga, gb, A_log, dt_bias, pool,
                                                                    step.indices), a.iters)
                    new = [str(c) for key, c in decode.decode_choices().items() if key not in before]
                    cells.append(f"{name}: {100 * state_bytes / ms / 1e6 / copy:5.1f}% {new[0] if new else '(same key)'}")
                print(f"{model:4} B={N:3} {str(dtype).removeprefix('torch.'):8} " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
