"""The cases of `hybridkv bench gdn`: the prefill and decode shapes, and each prefill shape's inputs.

`PREFILL_SHAPES` are the shapes of the prefill rows (`--shape` picks some through `_select`); `_inputs` makes one
shape's inputs from a seed of its own, so that the warm-up processes and the timing process call on the same tensors;
`_prefill_cases` hands them out one shape at a time (the probes in benchmarks/gdn take them from there too). torch is
imported inside the functions: `hybridkv bench gdn --help` does not load it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class PrefillShape:
    model: str
    H: int
    HV: int
    lens: tuple[int, ...]
    batched: bool = False  # [B, T] of equal sequences; else varlen (B = 1 with cu_seqlens) unless one sequence

    @property
    def label(self) -> str:
        n = len(self.lens)
        if self.batched:
            cut = f"{n}x{self.lens[0]}"
        elif n == 1:
            cut = f"1x{self.lens[0]}"
        elif len(set(self.lens)) == 1:
            cut = f"{n}x{self.lens[0]} varlen"
        else:
            cut = "varlen " + ",".join(map(str, self.lens))
        return f"{self.model} H={self.H} HV={self.HV} {cut}"


# Issue 23's table (FlashQLA's published H200 shapes and the batch/varlen regime of a prefill engine), and 397B
# 16x2048 varlen, which the README's table also has.
PREFILL_SHAPES = (
    PrefillShape(model="397B", H=16, HV=64, lens=(8192,)),
    PrefillShape(model="397B", H=16, HV=64, lens=(8192,) * 4, batched=True),
    PrefillShape(model="397B", H=16, HV=64, lens=(32768,)),
    PrefillShape(model="397B TP8", H=2, HV=8, lens=(8192,)),
    PrefillShape(model="397B", H=16, HV=64, lens=(2048,) * 16),
    PrefillShape(model="35B", H=16, HV=32, lens=(8192,)),
    PrefillShape(model="35B", H=16, HV=32, lens=(8192,) * 4, batched=True),
    PrefillShape(model="35B", H=16, HV=32, lens=(2048,) * 16),
    PrefillShape(model="35B", H=16, HV=32, lens=(5000, 1237, 1955, 3)),
)
DECODE_SHAPES = (("35B", 16, 32), ("397B", 16, 64))
DECODE_BATCHES = (64, 256)


class Pool(enum.Enum):
    """The slot pool a decode step runs in, as an engine lays it out (`decode_step`)."""

    VLLM = "vllm"
    SGLANG = "sglang"
    DENSE = "dense"


ENGINE_POOLS = ("vllm", "sglang")
PAD_SLOT_ID = -1  # vLLM's


@dataclass(frozen=True, kw_only=True)
class DecodeStep:
    """One step's state indices: ``indices`` (every row, pads included, in the engine's dtype) into a pool of
    ``slots`` slots; ``live`` the rows that are real sequences (int64, into ``indices``)."""

    slots: int
    indices: object
    live: object


def decode_step(pool: Pool, N: int, device) -> DecodeStep:
    """The state indices of a decode step of N sequences in ``pool``. vLLM: a pool 4x the batch whose block 0 is the
    null block, N distinct slots drawn at random from the rest, int32, the step padded with PAD_SLOT_ID to the next
    CUDA-graph capture size above N (multiples of 8: N / 8 pads at N = 64 or 256). SGLang: the same pool and draw,
    int64, its pads pointing at the reserved slot 0 (they compute on it; the pool's slot 0 is scratch). Dense: N of 2N
    slots at random, no pads, int64."""
    import torch

    if not isinstance(pool, Pool):
        raise ValueError(f"pool must be a Pool ({', '.join(p.value for p in Pool)}), got {pool!r}")
    if N < 1:
        raise ValueError(f"a decode step needs N >= 1 sequences, got {N}")
    if pool is Pool.DENSE:
        idx = torch.randperm(2 * N, device=device)[:N]
        return DecodeStep(slots=2 * N, indices=idx, live=torch.arange(N, device=device))
    slots = 4 * N
    live_slots = 1 + torch.randperm(slots - 1, device=device)[:N]
    pads = max(1, N // 8)
    pad = PAD_SLOT_ID if pool is Pool.VLLM else 0
    idx = torch.cat((live_slots, torch.full((pads,), pad, dtype=live_slots.dtype, device=device)))
    idx = idx.to(torch.int32 if pool is Pool.VLLM else torch.int64)  # pads after the live rows, as engines pad
    live = torch.arange(N, device=device)
    return DecodeStep(slots=slots, indices=idx, live=live)


def decode_inputs(rows: int, H: int, HV: int, device) -> tuple:
    """Random inputs of a decode step of ``rows`` rows, pads included: (q, k, v, a, b, A_log, dt_bias). q, k, v in
    bf16 as the layer's projection gives them; the raw gates a, b and the layer's A_log, dt_bias in fp32."""
    import torch

    q, k = (torch.randn(rows, H, D, device=device).bfloat16() for _ in range(2))
    v = torch.randn(rows, HV, D, device=device).bfloat16()
    a, b = torch.randn(rows, HV, device=device), torch.randn(rows, HV, device=device)
    A_log, dt_bias = torch.randn(HV, device=device) * 0.5, torch.randn(HV, device=device) * 0.5
    return q, k, v, a, b, A_log, dt_bias


def decode_pool(slots: int, HV: int, dtype, device):
    """A random state pool `[slots, HV, V, K]` of ``dtype``."""
    import torch

    return (torch.randn(slots, HV, D, D, device=device) * 0.1).to(dtype)
D = 128
CHUNK = 64
DEVICE = "cuda"  # where the prefill inputs are made (tests run the bench's bookkeeping on the CPU)


def _select(patterns: list[str] | None) -> tuple[tuple[int, PrefillShape], ...]:
    picked = tuple((i, s) for i, s in enumerate(PREFILL_SHAPES)
                   if patterns is None or any(p in s.label for p in patterns))
    if not picked:
        labels = "; ".join(s.label for s in PREFILL_SHAPES)
        raise ValueError(f"--shape {patterns} matches no prefill shape; the shapes are: {labels}")
    return picked


def _inputs(index: int):
    """The inputs of PREFILL_SHAPES[index], on the GPU, the same in every process: (B, T, args, kwargs)."""
    import torch
    import torch.nn.functional as F

    shape = PREFILL_SHAPES[index]
    gen = torch.Generator(device=DEVICE).manual_seed(1000 + index)
    lens = shape.lens
    B, T = (len(lens), lens[0]) if shape.batched else (1, sum(lens))

    def randn(*size, dtype=torch.bfloat16):
        return torch.randn(*size, device=DEVICE, generator=gen).to(dtype)

    q, k = randn(B, T, shape.H, D), randn(B, T, shape.H, D)
    v = randn(B, T, shape.HV, D)
    g = F.logsigmoid(randn(B, T, shape.HV, dtype=torch.float32) + 3.0)
    beta = torch.rand(B, T, shape.HV, device=DEVICE, generator=gen)
    cu = None
    if not shape.batched and len(lens) > 1:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    kw = dict(output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    return B, T, (q, k, v, g, beta), kw


def _prefill_cases(shapes: tuple[tuple[int, PrefillShape], ...] | None = None):
    """Each prefill shape's inputs, made on the GPU one shape at a time: (label, B, T, H, HV, args, kwargs)."""
    for index, shape in shapes or tuple(enumerate(PREFILL_SHAPES)):
        B, T, args, kw = _inputs(index)
        yield shape.label, B, T, shape.H, shape.HV, args, kw
