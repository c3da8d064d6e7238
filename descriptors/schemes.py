"""How many descriptors each engine's scheme issues for one request, side by side.

Every scheme sees the same workload: one request of `tokens` prompt tokens, the
same engine block size, the same TP pair. The engine schemes are closed-form
models of their code (docs/background/vllm.md sections 2-4 and 9, docs/background/sglang.md section 3);
`hybridkv` is not a model: it plans real layouts (virtual addresses) and runs
the planner the transport runs (descriptors/planning.py: the same pairing
decision and compiler), so its count is what NIXL posts for that request.

Counts are totals over all (prefill rank -> decode rank) reads of the request; `per_decode_rank` and
`per_prefill_rank` are the largest share one rank of that side takes part in (vLLM's and hybridkv's
connectors post from each decode rank, SGLang's and Mooncake's from each prefill rank: `POSTERS`), so
`SchemeCount.per_posting_rank` is what one posting thread builds and posts for the request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from hybridkv.layout import Layout, check_block_size, plan_layout
from hybridkv.layout.alloc import VirtualAllocator
from hybridkv.layout.geometry import LayerSpec, ModelGeometry, Paging
from hybridkv.transport.memory import from_layout
from hybridkv.transport.plan import TransferPlan
from hybridkv.transport.staging import Route, StagingConfig, StagingMode, route, slot_rows
from hybridkv.wire import Mem

from .hma import HMAPlan, PageOrder, aligned_block_size, plan_hma, vllm_layout
from .planning import DescriptorPlanner, source_ranks


class Side(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Scheme(enum.Enum):
    VLLM_LEGACY = "vllm-legacy"      # one per layer per K/V half per block, no HMA
    VLLM_HMA = "vllm-hma"            # PR #35758: HMA-shared tensors, K/V halves, SW tails
    VLLM_033 = "vllm-0.33"           # packed K/V per shared region, GDN conv/SSM sub-reads
    SGLANG_NIXL = "sglang-nixl"      # per page per layer buffer, no coalescing
    MOONCAKE = "mooncake"            # contiguous runs per layer buffer
    HYBRIDKV_VLLM = "hybridkv-vllm"  # vLLM 0.33 HMA pages in a block-outermost layout (BLHNC)
    HYBRIDKV = "hybridkv"            # planned layout + coalescing (real compiler)


@dataclass(frozen=True, kw_only=True)
class Poster:
    """Who posts a scheme's transfer: each rank of `side`, inside that side's engine step (`on_step`) or on
    a thread of the connector's own; `where` names the code, for the reader."""

    side: Side
    on_step: bool
    where: str


_VLLM_STEP = Poster(side=Side.DECODE, on_step=True,
                    where="NixlConnector.start_load_kv, in each decode worker's step (docs/background/vllm.md section 1)")
_SGLANG_WORKERS = ("SGLang's transfer worker threads on each prefill rank, WRITEs "
                   "(docs/background/sglang.md)")
POSTERS: dict[Scheme, Poster] = {
    Scheme.VLLM_LEGACY: _VLLM_STEP,
    Scheme.VLLM_HMA: _VLLM_STEP,
    Scheme.VLLM_033: _VLLM_STEP,
    Scheme.SGLANG_NIXL: Poster(side=Side.PREFILL, on_step=False, where=_SGLANG_WORKERS),
    Scheme.MOONCAKE: Poster(side=Side.PREFILL, on_step=False, where=_SGLANG_WORKERS),
    Scheme.HYBRIDKV_VLLM: Poster(side=Side.DECODE, on_step=False,
                                 where="hybridkv's transport thread on each decode worker (connectors/vllm/worker_half.py)"),
    Scheme.HYBRIDKV: Poster(side=Side.DECODE, on_step=False, where="hybridkv's transport thread on each decode rank"),
}


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
    # hybridkv's staging at different TP (transport/staging.py), as both sides of its connectors are
    # configured; None: no staging, every read sliced. Only the hybridkv schemes read it.
    staging: StagingConfig | None = StagingConfig()

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or self.tokens <= 0:
            raise ValueError(f"tokens must be a positive int, got {self.tokens!r}")
        if self.block_size is not None:
            check_block_size(self.block_size)
        for name in ("tp_prefill", "tp_decode"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if max(self.tp_prefill, self.tp_decode) % min(self.tp_prefill, self.tp_decode):
            raise ValueError(f"tp_prefill {self.tp_prefill} and tp_decode {self.tp_decode}: one must be a multiple "
                             "of the other (the engines' NIXL TP mapping)")
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

    @property
    def reads_per_decode_rank(self) -> int:
        """Prefill ranks one decode rank reads (its head slice of one, or several whole ones)."""
        return max(1, self.tp_prefill // self.tp_decode)

    @property
    def reads_per_prefill_rank(self) -> int:
        """Decode ranks that read one prefill rank (each its own head slice of it)."""
        return max(1, self.tp_decode // self.tp_prefill)


@dataclass(frozen=True, kw_only=True)
class SchemeCount:
    scheme: Scheme
    descriptors: int            # total over every (prefill rank, decode rank) read of the request
    bytes: int                  # total over the decode ranks
    regions: int                # regions registered per prefill rank
    per_decode_rank: int        # the most any one decode rank reads
    per_prefill_rank: int       # the most any one prefill rank is read by (or writes)
    bytes_per_decode_rank: int  # the most any one decode rank receives
    # What NIXL posts of `per_posting_rank` after merging pieces that touch on both sides, where this model
    # knows they touch (vLLM 0.33's kernel blocks of one logical block at equal TP); else the same count.
    nixl_posted_per_posting_rank: int

    @property
    def poster(self) -> Poster:
        return POSTERS[self.scheme]

    @property
    def per_posting_rank(self) -> int:
        """Descriptors (ids) one posting thread builds for the request: per decode rank or per prefill rank."""
        return self.per_decode_rank if self.poster.side is Side.DECODE else self.per_prefill_rank



def _closed_form(scheme: Scheme, w: Workload, *, per_read: int, nbytes: int, regions: int,
                 posted_per_read: int | None = None) -> SchemeCount:
    """A model's count from its per-read count: every read of the request costs the same."""
    posted = per_read if posted_per_read is None else posted_per_read
    poster_reads = (w.reads_per_decode_rank if POSTERS[scheme].side is Side.DECODE else w.reads_per_prefill_rank)
    return SchemeCount(scheme=scheme, descriptors=per_read * w.reads_per_request, bytes=nbytes, regions=regions,
                       per_decode_rank=per_read * w.reads_per_decode_rank,
                       per_prefill_rank=per_read * w.reads_per_prefill_rank,
                       bytes_per_decode_rank=nbytes // w.tp_decode, nixl_posted_per_posting_rank=posted * poster_reads)


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
    return _closed_form(Scheme.VLLM_LEGACY, w, per_read=per_read, nbytes=_useful_bytes(w, clip_window=False),
                        regions=_engine_regions(w))


def _vllm_hma_per_read(w: Workload, *, kv_halves: int, ppl: int) -> int:
    hma = _hma(w)
    r = hma.num_tensors
    per_read = 0
    for grp in hma.groups:
        if grp.spec.paging is Paging.STATE:
            # Read per sub-block (GDN: conv Q, K, V + SSM); never scaled by the kernel-block ratio.
            per_read += r * grp.spec.page_sub_reads * grp.blocks_for_tokens(w.tokens)
        else:
            per_read += kv_halves * r * grp.blocks_for_tokens(w.tokens) * ppl
    return per_read


def _vllm_hma(w: Workload) -> SchemeCount:
    return _closed_form(Scheme.VLLM_HMA, w, per_read=_vllm_hma_per_read(w, kv_halves=2, ppl=1),
                        nbytes=_useful_bytes(w), regions=2 * _hma(w).num_tensors)


def _vllm_033(w: Workload) -> SchemeCount:
    per_read = _vllm_hma_per_read(w, kv_halves=1, ppl=w.kernel_blocks_per_block)
    # At equal TP the kernel blocks of one logical block are whole and adjacent on both sides, so NIXL merges
    # their ids into one descriptor (touching pieces merge: docs/benchmarks/transfer.md, posting curve, DRAM).
    # At different TP each id is a head slice of its kernel block; the next kernel block's slice does not touch.
    merged = (_vllm_hma_per_read(w, kv_halves=1, ppl=1) if w.tp_prefill == w.tp_decode else per_read)
    return _closed_form(Scheme.VLLM_033, w, per_read=per_read, nbytes=_useful_bytes(w), regions=_hma(w).num_tensors,
                        posted_per_read=merged)


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
    return _closed_form(Scheme.SGLANG_NIXL, w, per_read=per_read, nbytes=_useful_bytes(w), regions=_engine_regions(w))


def _mooncake(w: Workload) -> SchemeCount:
    # Contiguous runs of blocks per layer buffer.
    per_read = sum(spec.engine_tensors * layers * runs(_blocks(w, spec), w.fragmentation)
                   for spec, layers in _kinds(w))
    return _closed_form(Scheme.MOONCAKE, w, per_read=per_read, nbytes=_useful_bytes(w), regions=_engine_regions(w))


def _hybridkv_vllm(w: Workload) -> SchemeCount:
    if w.tp_prefill != w.tp_decode:
        # Head slices, GQA-replicated heads read once, kernel blocks, staging: the planner on vLLM's pages.
        reads, regions = _vllm_reads(w)
        return _from_reads(Scheme.HYBRIDKV_VLLM, reads, regions=regions)
    hma = _hma(w)
    # Block-outermost: one block of a group is one span over its r layer pages.
    per_read = sum(runs(grp.blocks_for_tokens(w.tokens), w.fragmentation) for grp in hma.groups)
    nbytes = sum(grp.blocks_for_tokens(w.tokens) for grp in hma.groups) * hma.num_tensors * hma.page_bytes
    return _closed_form(Scheme.HYBRIDKV_VLLM, w, per_read=per_read, regions=1, nbytes=nbytes * w.reads_per_request)


def _vllm_pages(w: Workload, tp: int, rank: int, pages: int, alloc: VirtualAllocator) -> Layout:
    """vLLM 0.33's hybrid-allocator tensors of one rank (virtual addresses), as the vLLM connector adopts them:
    block-outermost (BLHNC, what the connector asks for), or layer-outermost (LBHNC) with attention kernel
    blocks smaller than the block: vLLM splits a page into kernel blocks only there, so the backend that needs
    them is one that does not allow BLHNC."""
    split = w.kernel_blocks_per_block > 1
    return vllm_layout(w.geometry, tp=tp, rank=rank, block=w.effective_block_size, pages=pages, allocator=alloc,
                       order=PageOrder.LAYER_OUTERMOST if split else PageOrder.BLOCK_OUTERMOST,
                       kernel=w.kernel_block_size if split else None)


def _vllm_reads(w: Workload) -> tuple[list[tuple[int, int, TransferPlan]], int]:
    """(prefill rank, decode rank, plan) of every read the vLLM connector posts at different TP: the planner
    over every rank's vLLM pages (:func:`_vllm_pages`), its blocks from one pool as vLLM's hybrid allocator
    hands them out (each group's after the last's, ``fragmentation`` of them apart), staged by the
    transport's own rule (:func:`_staged`); and the regions one prefill rank registers."""
    blocks: dict[int, np.ndarray] = {}
    at = 0
    for grp in _hma(w).groups:  # same groups and block size at every TP
        blocks[grp.group_id] = fragmented_blocks(grp.blocks_for_tokens(w.tokens), w.fragmentation, start=at)
        at = int(blocks[grp.group_id][-1]) + 2
    alloc = VirtualAllocator()
    srcs = [from_layout(_vllm_pages(w, w.tp_prefill, r, at, alloc)) for r in range(w.tp_prefill)]
    planner = DescriptorPlanner()
    reads = []
    for d in range(w.tp_decode):
        ranks, _ = source_ranks(w.tp_decode, d, w.tp_prefill)
        prepared = planner.prepare([srcs[r] for r in ranks], from_layout(_vllm_pages(w, w.tp_decode, d, at, alloc)))
        for i, src in enumerate(ranks):
            plan = _staged(w, prepared, i, blocks, blocks, prepared.plan(i, blocks, blocks))
            if plan.num_descriptors:  # a rank that feeds none of this rank's fields is not read
                reads.append((src, d, plan))
    return reads, len(srcs[0].regions)


def _hybridkv_reads(w: Workload) -> list[tuple[int, int, TransferPlan]]:
    """(prefill rank, decode rank, plan) of every read hybridkv's transport posts for this workload,
    the prefill ranks of each decode rank as a connector picks them (source_ranks)."""
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
    reads = []
    for d in range(w.tp_decode):
        dst = plan_layout(g, block_size=bd, num_blocks=pages, allocator=alloc, tp=w.tp_decode, rank=d)
        ranks, _ = source_ranks(w.tp_decode, d, w.tp_prefill)
        prepared = planner.prepare([src_maps[r] for r in ranks], from_layout(dst))
        sb, db = {}, {}
        for grp in dst.groups:
            ns, nd = blocks_needed[grp.kind]
            sb[grp.group_id] = fragmented_blocks(ns, w.fragmentation)
            db[grp.group_id] = fragmented_blocks(nd, w.fragmentation)
        for i, src in enumerate(ranks):
            plan = _staged(w, prepared, i, sb, db, prepared.plan(i, sb, db))
            if plan.num_descriptors:  # a rank that feeds none of this rank's fields is not read
                reads.append((src, d, plan))
    return reads


#: where the analyzer puts a producer's staging slot (any address: only contiguity counts)
_SLOT_BASE = 1 << 46
#: the memory the analyzer weighs staging's copies in: a deployment's caches are on its GPUs
STAGING_MEM = Mem.VRAM


def _staged(w: Workload, prepared, source: int, sb, db, sliced: TransferPlan) -> TransferPlan:
    """What the consumer posts for one read with staging, by the transport's own rule
    (transport/staging.py ``route``; transport/fetch.py applies it to the same plans)."""
    stager_of = getattr(prepared, "stager", None)
    if w.staging is None or w.staging.mode is StagingMode.OFF or stager_of is None:
        return sliced
    stager = stager_of(source)
    if stager is None:
        return sliced
    direct = stager.read(_SLOT_BASE, 0, sb, db)
    way = route(w.staging, sliced=sliced.num_descriptors, direct=direct.num_descriptors,
                own_pool=w.staging.enabled, nbytes=stager.nbytes(sb), mem=STAGING_MEM)
    if way is Route.SLICED:
        return sliced
    if way is Route.DIRECT:
        return direct if direct.num_descriptors <= sliced.num_descriptors else sliced
    return slot_rows(_SLOT_BASE, 0, 2 * _SLOT_BASE, 0, stager.nbytes(sb))


def hybridkv_plans(w: Workload) -> list[TransferPlan]:
    """The real plans hybridkv's transport posts for this workload: one per (src rank, dst rank) read."""
    return [plan for _, _, plan in _hybridkv_reads(w)]


def _hybridkv(w: Workload) -> SchemeCount:
    return _from_reads(Scheme.HYBRIDKV, _hybridkv_reads(w), regions=len(w.geometry.kinds()))


def _from_reads(scheme: Scheme, reads: list[tuple[int, int, TransferPlan]], *, regions: int) -> SchemeCount:
    """A scheme's count from the plans of its reads, each (prefill rank, decode rank, plan); the posting rank
    (a decode rank: both hybridkv schemes pull) posts its reads' descriptors. ``regions``: per prefill rank."""
    def most(ranks: list[int], sizes: list[int]) -> int:
        per: dict[int, int] = {}
        for rank, size in zip(ranks, sizes):
            per[rank] = per.get(rank, 0) + size
        return max(per.values(), default=0)

    src, dst = [r[0] for r in reads], [r[1] for r in reads]
    counts, sizes = [r[2].num_descriptors for r in reads], [r[2].nbytes for r in reads]
    per_decode = most(dst, counts)
    return SchemeCount(scheme=scheme, descriptors=sum(counts), bytes=sum(sizes),
                       regions=regions, per_decode_rank=per_decode,
                       per_prefill_rank=most(src, counts), bytes_per_decode_rank=most(dst, sizes),
                       nixl_posted_per_posting_rank=per_decode)


_COUNTERS = {
    Scheme.VLLM_LEGACY: _vllm_legacy,
    Scheme.VLLM_HMA: _vllm_hma,
    Scheme.VLLM_033: _vllm_033,
    Scheme.SGLANG_NIXL: _sglang_nixl,
    Scheme.MOONCAKE: _mooncake,
    Scheme.HYBRIDKV_VLLM: _hybridkv_vllm,
    Scheme.HYBRIDKV: _hybridkv,
}
