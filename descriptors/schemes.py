"""How many descriptors each engine's scheme issues for one request, side by side.

Every scheme sees the same workload: one request of `tokens` prompt tokens, the
same engine block size, the same TP pair. The engine schemes are closed-form
models of their code (docs/background/vllm.md sections 2-4 and 9, docs/background/sglang.md section 3);
`hybridkv` is not a model: it plans real layouts (virtual addresses) and runs
the planner the transport runs (descriptors/planning.py: the same pairing
decision and compiler), so its count is what NIXL posts for that request.

Counts are totals over all (prefill rank -> decode rank) reads of the request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from hybridkv.layout import check_block_size, plan_layout
from hybridkv.layout.alloc import VirtualAllocator
from hybridkv.layout.geometry import LayerSpec, ModelGeometry, Paging
from hybridkv.transport.memory import from_layout
from hybridkv.transport.plan import TransferPlan

from .hma import HMAPlan, aligned_block_size, plan_hma
from .planning import DescriptorPlanner, source_ranks


class Scheme(enum.Enum):
    VLLM_LEGACY = "vllm-legacy"      # one per layer per K/V half per block, no HMA
    VLLM_HMA = "vllm-hma"            # PR #35758: HMA-shared tensors, K/V halves, SW tails
    VLLM_033 = "vllm-0.33"           # packed K/V per shared region, GDN conv/SSM sub-reads
    SGLANG_NIXL = "sglang-nixl"      # per page per layer buffer, no coalescing
    MOONCAKE = "mooncake"            # contiguous runs per layer buffer
    HYBRIDKV_VLLM = "hybridkv-vllm"  # vLLM 0.33 HMA pages in a block-outermost layout (BLHNC)
    HYBRIDKV = "hybridkv"            # planned layout + coalescing (real compiler)


@dataclass(frozen=True, kw_only=True)
class Workload:
    geometry: ModelGeometry
    tokens: int
    block_size: int | None = None   # None: the engine's (HMA-aligned) default
    tp_prefill: int = 1
    tp_decode: int = 1
    fragmentation: float = 1.0      # fraction of consecutive block pairs NOT adjacent in memory
    # Attention kernel block size. vLLM 0.33 registers NIXL descriptors per kernel block, so when a
    # backend splits the HMA-raised logical block (e.g. FlashInfer's 16/32/64-token blocks) every
    # logical block costs block/kernel descriptors per region. None: kernel block = logical block.
    kernel_block_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or self.tokens <= 0:
            raise ValueError(f"tokens must be a positive int, got {self.tokens!r}")
        if self.block_size is not None:
            check_block_size(self.block_size)
        for name in ("tp_prefill", "tp_decode"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not 0.0 <= self.fragmentation <= 1.0:
            raise ValueError(f"fragmentation must be in [0, 1], got {self.fragmentation}")
        if self.kernel_block_size is not None:
            check_block_size(self.kernel_block_size)
            if self.effective_block_size % self.kernel_block_size:
                raise ValueError(f"kernel block size {self.kernel_block_size} must divide the block size "
                                 f"{self.effective_block_size}")
        # Sharding validates that both TPs divide the heads; do it early for a clear error.
        self.geometry.shard(self.tp_prefill)
        self.geometry.shard(self.tp_decode)

    @property
    def prefill_rank_geometry(self) -> ModelGeometry:
        return self.geometry.shard(self.tp_prefill)

    @property
    def effective_block_size(self) -> int:
        """One block size for both sides: the larger HMA-aligned size, so both pages hold a state."""
        return max(aligned_block_size(self.geometry.shard(tp), self.block_size)
                   for tp in (self.tp_prefill, self.tp_decode))

    @property
    def decode_block_size(self) -> int:
        return self.effective_block_size

    @property
    def kernel_blocks_per_block(self) -> int:
        return 1 if self.kernel_block_size is None else self.effective_block_size // self.kernel_block_size

    @property
    def reads_per_request(self) -> int:
        """(prefill rank, decode rank) pairs that move data: each decode rank reads its
        head slice of one prefill rank, or the slices of several when prefill TP is larger."""
        return max(self.tp_prefill, self.tp_decode)


@dataclass(frozen=True, kw_only=True)
class SchemeCount:
    scheme: Scheme
    descriptors: int
    bytes: int
    regions: int  # regions registered per prefill rank


def runs(n: int, fragmentation: float) -> int:
    """Contiguous runs among n blocks when a fraction F of consecutive pairs is not adjacent."""
    if n <= 0:
        return 0
    return 1 + round((n - 1) * fragmentation)


def fragmented_blocks(n: int, fragmentation: float, *, start: int = 0) -> np.ndarray:
    """n block ids where pair (i, i+1) is non-adjacent iff floor((i+1)F) > floor(iF)."""
    i = np.arange(n, dtype=np.int64)
    gaps = np.floor(i * fragmentation).astype(np.int64)
    return start + i + gaps


def count_descriptors(scheme: Scheme, workload: Workload) -> SchemeCount:
    return _COUNTERS[scheme](workload)


def count_all(workload: Workload, schemes: tuple[Scheme, ...] = tuple(Scheme)) -> list[SchemeCount]:
    return [count_descriptors(s, workload) for s in schemes]


# --------------------------------------------------------------------------- helpers


def _hma(w: Workload) -> HMAPlan:
    return plan_hma(w.prefill_rank_geometry, w.effective_block_size)


def _useful_bytes(w: Workload, clip_window: bool = True) -> int:
    """Bytes one request really needs moved (all decode ranks): attention KV of its blocks + GDN states.

    KV heads that a decode TP above the head count replicates are counted once per rank holding them.
    """
    b = w.effective_block_size
    total = sum(s.blocks_for_tokens(w.tokens, b, clip_window=clip_window) * s.page_bytes(b)
                for s in w.geometry.shard(w.tp_decode).layers)
    return total * w.tp_decode


def _kinds(w: Workload) -> list[tuple[LayerSpec, int]]:
    """(spec, layer count) of each kind of the model: the engine models count per kind from these."""
    g = w.geometry
    return [(g.spec_of(k), len(g.layer_indices(k))) for k in g.kinds()]


def _blocks(w: Workload, spec: LayerSpec, clip_window: bool = True) -> int:
    return spec.blocks_for_tokens(w.tokens, w.effective_block_size, clip_window=clip_window)


def _engine_regions(w: Workload) -> int:
    """Regions an engine registering each layer's unpacked tensors has (vLLM legacy, SGLang, Mooncake)."""
    return sum(spec.engine_tensors * layers for spec, layers in _kinds(w))


# --------------------------------------------------------------------------- schemes


def _vllm_legacy(w: Workload) -> SchemeCount:
    # No HMA: every attention layer holds every block (no window clipping), K and V
    # are separate regions; GDN layers modelled as conv + SSM regions, one state each.
    per_read = sum(spec.engine_tensors * layers * _blocks(w, spec, clip_window=False) for spec, layers in _kinds(w))
    return SchemeCount(scheme=Scheme.VLLM_LEGACY, descriptors=per_read * w.reads_per_request,
                       bytes=_useful_bytes(w, clip_window=False), regions=_engine_regions(w))


def _vllm_hma_like(w: Workload, *, kv_halves: int, scheme: Scheme, ppl: int = 1) -> SchemeCount:
    hma = _hma(w)
    r = hma.num_tensors
    per_read = 0
    for grp in hma.groups:
        if grp.spec.paging is Paging.STATE:
            # Read per sub-block (GDN: conv Q, K, V + SSM); never scaled by the kernel-block ratio.
            per_read += r * grp.spec.page_sub_reads * grp.blocks_for_tokens(w.tokens)
        else:
            per_read += kv_halves * r * grp.blocks_for_tokens(w.tokens) * ppl
    return SchemeCount(scheme=scheme, descriptors=per_read * w.reads_per_request, bytes=_useful_bytes(w),
                       regions=kv_halves * r)


def _vllm_hma(w: Workload) -> SchemeCount:
    return _vllm_hma_like(w, kv_halves=2, scheme=Scheme.VLLM_HMA)


def _vllm_033(w: Workload) -> SchemeCount:
    return _vllm_hma_like(w, kv_halves=1, scheme=Scheme.VLLM_033, ppl=w.kernel_blocks_per_block)


def _sglang_nixl(w: Workload) -> SchemeCount:
    per_read = 0
    for spec, layers in _kinds(w):
        if w.tp_prefill == w.tp_decode:
            # One descriptor per page per layer buffer (K and V; conv and temporal (SSM) state).
            per_read += spec.engine_tensors * layers * _blocks(w, spec)
        elif spec.paging is Paging.TOKENS:
            # SGLang's slice path: a head slice of an NHD page is strided, one descriptor per token of
            # every page per K/V layer buffer (expand_page_indices_for_slice).
            per_read += spec.engine_tensors * layers * _blocks(w, spec) * w.effective_block_size
        else:
            # A GDN state slice is one per q/k/v sub-block of the conv state plus one for the SSM
            # (compute_mamba_state_slice_byte_blocks).
            per_read += spec.page_sub_reads * layers * _blocks(w, spec)
    return SchemeCount(scheme=Scheme.SGLANG_NIXL, descriptors=per_read * w.reads_per_request,
                       bytes=_useful_bytes(w), regions=_engine_regions(w))


def _mooncake(w: Workload) -> SchemeCount:
    # Contiguous runs of blocks per layer buffer.
    per_read = sum(spec.engine_tensors * layers * runs(_blocks(w, spec), w.fragmentation)
                   for spec, layers in _kinds(w))
    return SchemeCount(scheme=Scheme.MOONCAKE, descriptors=per_read * w.reads_per_request,
                       bytes=_useful_bytes(w), regions=_engine_regions(w))


def _hybridkv_vllm(w: Workload) -> SchemeCount:
    hma = _hma(w)
    r = hma.num_tensors
    same_tp = w.tp_prefill == w.tp_decode
    per_read = 0
    nbytes = 0
    for grp in hma.groups:
        n = grp.blocks_for_tokens(w.tokens)
        if same_tp:
            # Block-outermost: one block of a group is one span over its r layer pages.
            per_read += runs(n, w.fragmentation)
            nbytes += n * r * hma.page_bytes
        else:
            # A head slice is contiguous only inside one layer's page, and there per sub-block.
            per_read += r * grp.spec.page_sub_reads * n
    if not same_tp:
        nbytes = _useful_bytes(w) // w.reads_per_request
    return SchemeCount(scheme=Scheme.HYBRIDKV_VLLM, descriptors=per_read * w.reads_per_request,
                       bytes=nbytes * w.reads_per_request if same_tp else _useful_bytes(w), regions=1)


def hybridkv_plans(w: Workload) -> list[TransferPlan]:
    """The real plans hybridkv's transport posts for this workload: one per (src rank, dst rank)
    read, the src ranks of each dst rank as a connector picks them (source_ranks)."""
    g = w.geometry
    bs, bd = w.effective_block_size, w.decode_block_size
    blocks_needed = {kind: (g.spec_of(kind).blocks_for_tokens(w.tokens, bs),
                            g.spec_of(kind).blocks_for_tokens(w.tokens, bd)) for kind in g.kinds()}
    pages = {k: 2 * max(v) + 2 for k, v in blocks_needed.items()}
    alloc = VirtualAllocator()
    srcs = [plan_layout(g, block_size=bs, num_blocks=pages, allocator=alloc, tp=w.tp_prefill, rank=r)
            for r in range(w.tp_prefill)]
    src_maps = [from_layout(s) for s in srcs]
    planner = DescriptorPlanner()
    plans = []
    for d in range(w.tp_decode):
        dst = plan_layout(g, block_size=bd, num_blocks=pages, allocator=alloc, tp=w.tp_decode, rank=d)
        ranks, _ = source_ranks(w.tp_decode, d, w.tp_prefill)
        prepared = planner.prepare([src_maps[r] for r in ranks], from_layout(dst))
        sb, db = {}, {}
        for grp in dst.groups:
            ns, nd = blocks_needed[grp.kind]
            sb[grp.group_id] = fragmented_blocks(ns, w.fragmentation)
            db[grp.group_id] = fragmented_blocks(nd, w.fragmentation)
        for i in range(len(ranks)):
            plan = prepared.plan(i, sb, db)
            if plan.num_descriptors:  # a rank that feeds none of this rank's fields is not read
                plans.append(plan)
    return plans


def _hybridkv(w: Workload) -> SchemeCount:
    plans = hybridkv_plans(w)
    return SchemeCount(scheme=Scheme.HYBRIDKV, descriptors=sum(p.num_descriptors for p in plans),
                       bytes=sum(p.nbytes for p in plans), regions=len(w.geometry.kinds()))


_COUNTERS = {
    Scheme.VLLM_LEGACY: _vllm_legacy,
    Scheme.VLLM_HMA: _vllm_hma,
    Scheme.VLLM_033: _vllm_033,
    Scheme.SGLANG_NIXL: _sglang_nixl,
    Scheme.MOONCAKE: _mooncake,
    Scheme.HYBRIDKV_VLLM: _hybridkv_vllm,
    Scheme.HYBRIDKV: _hybridkv,
}
