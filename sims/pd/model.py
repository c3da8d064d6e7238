"""What the simulator needs from the model and the descriptor analyzer, in one place.

`request_transfer` is the only call into the descriptor analyzer: the simulator never
holds a descriptor count of its own. `cache_model` sizes a cache the way the scheme's engine
allocates it: vLLM's hybrid allocator (one block of any group takes one page in each of the
group_size shared tensors; sliding-window groups keep only their tail) for every scheme but
`vllm-legacy`, which predates HMA and keeps every block of every attention layer, sliding
window included (docs/background/vllm.md section 4, PR #35758's non-HMA path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridkv.descriptors.hma import plan_hma
from hybridkv.layout.geometry import ModelGeometry
from hybridkv.layout.kinds.base import Paging
from hybridkv.layout.presets import get_preset

from .params import Sizing

NON_HMA_SCHEMES = ("vllm-legacy",)


@dataclass(frozen=True, kw_only=True)
class TransferCount:
    scheme: str
    descriptors: int   # every read of the request: what crosses the decode rank's link
    posted: int        # what one posting thread builds and posts (the analyzer's per_posting_rank)
    bytes: int         # over every GPU of the decode rank


def model_geometry(preset: str, ssm_dtype: str | None) -> ModelGeometry:
    return get_preset(preset, ssm_dtype=ssm_dtype)


def scheme_names() -> tuple[str, ...]:
    from hybridkv.descriptors.schemes import Scheme

    return tuple(s.value for s in Scheme)


def check_scheme(scheme: str) -> str:
    names = scheme_names()
    if scheme not in names:
        raise ValueError(f"transfer scheme {scheme!r}: expected one of {', '.join(names)}")
    return scheme


def posts_on_step(scheme: str) -> bool:
    """Whether `scheme`'s connector posts on the decode step (else on a thread of its own): the analyzer's
    POSTERS (vLLM's NixlConnector in start_load_kv on the decode step; hybridkv on its transport thread;
    SGLang and Mooncake on the prefill's transfer threads)."""
    from hybridkv.descriptors.schemes import POSTERS, Scheme

    return POSTERS[Scheme(check_scheme(scheme))].on_step


def transfer_workload(geometry: ModelGeometry, *, tokens: int, block_size: int | None,
                      kernel_block_size: int | None = None, tp_prefill: int = 1, tp_decode: int = 1,
                      fragmentation: float = 1.0):
    """The analyzer's workload of one request (its checks: TP pair against the heads and each other,
    kernel block against the block)."""
    from hybridkv.descriptors.schemes import Workload

    return Workload(geometry=geometry, tokens=tokens, block_size=block_size, tp_prefill=tp_prefill,
                    tp_decode=tp_decode, fragmentation=fragmentation, kernel_block_size=kernel_block_size)


def check_kernel_block_size(geometry: ModelGeometry, *, block_size: int | None, kernel_block_size: int,
                            tp_prefill: int = 1, tp_decode: int = 1) -> None:
    """Refuses a kernel block that does not divide the logical block (the analyzer's rule), naming both."""
    try:
        transfer_workload(geometry, tokens=1, block_size=block_size, kernel_block_size=kernel_block_size,
                          tp_prefill=tp_prefill, tp_decode=tp_decode)
    except ValueError as exc:
        raise ValueError(f"model.kernel_block_size={kernel_block_size!r}: {exc}") from None


def check_tp(geometry: ModelGeometry, *, tp_prefill: int, tp_decode: int) -> None:
    """Refuses an attention TP pair the model's heads or the engines' TP mapping cannot take, naming both."""
    try:
        transfer_workload(geometry, tokens=1, block_size=None, tp_prefill=tp_prefill, tp_decode=tp_decode)
    except ValueError as exc:
        raise ValueError(f"prefill.attention_tp={tp_prefill!r}, decode.attention_tp={tp_decode!r}: {exc}") from None


def request_transfer(scheme: str, geometry: ModelGeometry, *, tokens: int, block_size: int | None,
                     fragmentation: float, kernel_block_size: int | None = None, tp_prefill: int = 1,
                     tp_decode: int = 1) -> TransferCount:
    """Descriptors and bytes one request's prompt cache costs to move under `scheme`, from the analyzer.

    A simulated rank is one attention DP rank of `tp` GPUs. At attention TP 1 (the seed's DEP
    endpoints) it is one GPU holding the request's whole attention/GDN cache, and the transfer is
    rank-to-rank. At TP > 1 every GPU of the decode rank reads its head slice from the prefill GPUs
    its connector maps it to: all of those reads cross the link (`descriptors`, `bytes`), and each
    GPU's posting thread posts its own part in parallel, so one thread's count (`posted`, the
    analyzer's per_posting_rank: per decode GPU for vLLM and hybridkv, per prefill GPU for SGLang and
    Mooncake) is what a transfer's posting costs.
    """
    try:
        from hybridkv.descriptors.schemes import Scheme, count_descriptors
    except ImportError as exc:
        raise RuntimeError(
            f"the descriptor analyzer (hybridkv.descriptors.schemes) is not available: {exc}") from exc
    chosen = Scheme(check_scheme(scheme))
    count = count_descriptors(chosen, transfer_workload(
        geometry, tokens=tokens, block_size=block_size, tp_prefill=tp_prefill, tp_decode=tp_decode,
        fragmentation=fragmentation, kernel_block_size=kernel_block_size))
    return TransferCount(scheme=chosen.value, descriptors=int(count.descriptors), posted=int(count.per_posting_rank),
                         bytes=int(count.bytes))


@dataclass(frozen=True, kw_only=True)
class CacheModel:
    """How a scheme's engine stores one request: blocks of `block_bytes`, `block_size` tokens each."""

    scheme: str
    block_size: int
    block_bytes: int
    # Per group: (is GDN, sliding window or None); `blocks(tokens)` sums over them.
    groups: tuple[tuple[bool, int | None], ...]

    def blocks(self, tokens: int) -> int:
        if tokens <= 0:
            raise ValueError(f"tokens={tokens}: expected a positive count")
        n = math.ceil(tokens / self.block_size)
        total = 0
        for gdn, window in self.groups:
            if gdn:
                total += 1
            elif window is not None:
                total += min(n, math.ceil(window / self.block_size) + 1)
            else:
                total += n
        return total

    def per_rank(self, cache_bytes: float, what: str) -> int:
        blocks = math.floor(cache_bytes / self.block_bytes)
        if blocks < 1:
            raise ValueError(f"{what}={cache_bytes!r} holds no block of {self.block_bytes} B")
        return blocks


def cache_model(geometry: ModelGeometry, scheme: str, *, block_size: int | None) -> CacheModel:
    plan = plan_hma(geometry, block_size=block_size)
    if scheme not in NON_HMA_SCHEMES:
        return CacheModel(scheme=scheme, block_size=plan.block_size, block_bytes=plan.page_bytes * plan.num_tensors,
                          groups=tuple((g.spec.paging is Paging.STATE, g.window) for g in plan.groups))
    # No HMA: one block holds `block_size` tokens of every attention layer, all of them kept
    # (no window clipping); GDN state, where a model has it, stays one padded page per layer.
    tokens = [s for s in geometry.layers if s.paging is Paging.TOKENS]
    states = [s for s in geometry.layers if s.paging is Paging.STATE]
    block_bytes = sum(s.page_bytes(plan.block_size) for s in tokens)
    groups: list[tuple[bool, int | None]] = [(False, None)]
    if states:
        state_blocks = math.ceil(sum(s.page_bytes(plan.block_size) for s in states) / block_bytes)
        groups += [(True, None)] * state_blocks
    return CacheModel(scheme=scheme, block_size=plan.block_size, block_bytes=block_bytes, groups=tuple(groups))


def sizing(geometry: ModelGeometry, scheme: str, *, block_size: int | None, fragmentation: float,
           decode: CacheModel, prefill: CacheModel, kernel_block_size: int | None = None, tp_prefill: int = 1,
           tp_decode: int = 1) -> Sizing:
    # Whole blocks move, so one analyzer count per block count serves every prompt length (and
    # every point and seed of a sweep: hybridkv's count runs the real compiler).
    counts: dict[int, TransferCount] = {}

    def count(isl: int) -> TransferCount:
        blocks = math.ceil(isl / decode.block_size)
        got = counts.get(blocks)
        if got is None:
            got = counts[blocks] = request_transfer(
                scheme, geometry, tokens=isl, block_size=block_size, fragmentation=fragmentation,
                kernel_block_size=kernel_block_size, tp_prefill=tp_prefill, tp_decode=tp_decode)
        return got

    if decode.block_size != prefill.block_size:
        raise ValueError(f"prefill block size {prefill.block_size} != decode block size {decode.block_size}")
    return Sizing(transfer=lambda isl: (count(isl).descriptors, count(isl).bytes), posted=lambda isl: count(isl).posted,
                  decode_blocks=decode.blocks, prefill_blocks=prefill.blocks, block_tokens=decode.block_size)
