"""What the simulator needs from the model and the descriptor analyzer, in one place.

`request_transfer` is the only call into the descriptor analyzer: the simulator never
holds a descriptor count of its own. `request_blocks` / `blocks_per_rank` size the decode
cache the way vLLM's hybrid allocator does (one block of any group takes one page in
each of the group_size shared tensors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridkv.layout.geometry import ModelGeometry
from descriptors.hma import plan_hma
from hybridkv.layout.presets import get_preset


@dataclass(frozen=True, kw_only=True)
class TransferCount:
    scheme: str
    descriptors: int
    bytes: int


def model_geometry(preset: str, ssm_dtype: str | None) -> ModelGeometry:
    return get_preset(preset, ssm_dtype=ssm_dtype)


def request_transfer(scheme: str, geometry: ModelGeometry, *, tokens: int,
                     block_size: int | None, fragmentation: float) -> TransferCount:
    """Descriptors and bytes one request's prompt cache costs to move under `scheme`.

    Data+expert parallel endpoints keep a request's whole attention/GDN cache on one rank,
    so the transfer is rank-to-rank with TP 1 on both sides.
    """
    try:
        from descriptors.schemes import Scheme, Workload, count_descriptors
    except ImportError as exc:
        raise RuntimeError(
            f"the descriptor analyzer (descriptors.schemes) is not available: {exc}") from exc
    try:
        chosen = Scheme(scheme)
    except ValueError:
        names = ", ".join(s.value for s in Scheme)
        raise ValueError(f"transfer scheme {scheme!r}: expected one of {names}") from None
    count = count_descriptors(chosen, Workload(
        geometry=geometry, tokens=tokens, block_size=block_size, tp_prefill=1, tp_decode=1,
        fragmentation=fragmentation))
    return TransferCount(scheme=chosen.value, descriptors=int(count.descriptors), bytes=int(count.bytes))


@dataclass(frozen=True, kw_only=True)
class DecodeMemory:
    block_size: int
    block_bytes: int
    request_blocks: int
    blocks_per_rank: int


def decode_memory(geometry: ModelGeometry, *, tokens: int, cache_bytes_per_rank: float,
                  block_size: int | None) -> DecodeMemory:
    """Blocks a request holds at `tokens` tokens and blocks a rank's cache holds."""
    plan = plan_hma(geometry, block_size=block_size)
    block_bytes = plan.page_bytes * plan.num_tensors
    request_blocks = sum(plan.blocks_per_group(tokens).values())
    per_rank = math.floor(cache_bytes_per_rank / block_bytes)
    if per_rank < request_blocks:
        raise ValueError(
            f"decode cache of {cache_bytes_per_rank / 2**30:.2f} GiB per rank holds {per_rank} blocks of "
            f"{block_bytes} B; one request of {tokens} tokens needs {request_blocks}")
    return DecodeMemory(block_size=plan.block_size, block_bytes=block_bytes,
                        request_blocks=request_blocks, blocks_per_rank=per_rank)
