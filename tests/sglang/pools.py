"""Memory of one rank of a small hybrid model, laid out as SGLang allocates it.

One tensor per full-attention layer for K and for V (NHD: [tokens, local KV
heads, head dim]; item = one page of one layer), and per Mamba state tensor one
[layers, slots + 1, ...] tensor whose per-layer slices are the
`state_data_ptrs` (item = one slot). GDN conv state is [q | k | v] channels x
(kernel - 1), each of q, k, v sharded by attention TP on its own (SGLang's
`conv_shard_groups`); the temporal (SSM) state is [value heads, dv, dk].

A rank's contents are its slice of one global model state drawn from a seed,
cut as SGLang shards it, so a decode rank of any TP knows what it must receive.
"""

from __future__ import annotations

from dataclasses import dataclass

PAGE_SIZE = 4
NUM_PAGES = 64
KV_HEADS, HEAD_DIM = 2, 16
ATTN_LAYERS = (3, 7)  # Qwen3.5-style: every 4th layer is full attention
GDN_LAYERS = (0, 1, 2, 4, 5, 6)
K_HEADS, V_HEADS, HEAD_K, HEAD_V = 4, 8, 4, 4
CONV_GROUPS = (K_HEADS * HEAD_K, K_HEADS * HEAD_K, V_HEADS * HEAD_V)  # q, k, v channels
CONV_KERNEL = 4
MAMBA_SLOTS = 8
AUX_ROWS, AUX_ITEM = 16, 64


def kv_heads_of(total: int, tp: int, rank: int) -> range:
    if tp <= total:
        return range(rank * (total // tp), (rank + 1) * (total // tp))
    h = rank // (tp // total)
    return range(h, h + 1)


def conv_channels_of(tp: int, rank: int) -> list[tuple[str, range]]:
    """(sub-block, global channels inside it) a rank holds, in its [q | k | v] order."""
    return [(name, range(rank * (n // tp), (rank + 1) * (n // tp))) for name, n in zip("qkv", CONV_GROUPS)]


@dataclass
class Pools:
    k: list
    v: list
    conv: object
    ssm: object
    aux: object
    tp: int = 1
    rank: int = 0
    kv_heads: int = KV_HEADS

    def kv_args(self):
        from sglang.srt.disaggregation.base.conn import KVArgs, StateType

        a = KVArgs()
        a.engine_rank = self.rank
        bufs = self.k + self.v
        a.kv_data_ptrs = [t.data_ptr() for t in bufs]
        a.kv_data_lens = [t.nbytes for t in bufs]
        a.kv_item_lens = [t[0].nbytes * PAGE_SIZE for t in bufs]
        a.kv_layer_ids = list(ATTN_LAYERS) * 2
        a.kv_cache_dtype_str = "bfloat16"
        a.kv_layout = None
        a.page_size = PAGE_SIZE
        a.kv_head_num = len(kv_heads_of(self.kv_heads, self.tp, self.rank))
        a.total_kv_head_num = self.kv_heads
        a.num_draft_entries = 0
        a.aux_data_ptrs = [self.aux.data_ptr()]
        a.aux_data_lens = [self.aux.nbytes]
        a.aux_item_lens = [self.aux[0].nbytes]
        n = len(GDN_LAYERS)
        state = [self.conv[i] for i in range(n)] + [self.ssm[i] for i in range(n)]
        a.state_types = [StateType.MAMBA]
        a.state_data_ptrs = [[t.data_ptr() for t in state]]
        a.state_data_lens = [[t.nbytes for t in state]]
        a.state_item_lens = [[t[0].nbytes for t in state]]
        a.state_layer_ids = [list(GDN_LAYERS) * 2]
        a.state_dim_per_tensor = [[t.shape[1] for t in state]]
        a.state_slice_outer_counts = [[1] * len(state)]
        a.state_conv_shard_groups = [[list(CONV_GROUPS)] * n + [None] * n]
        a.is_hybrid_mla_backend = False
        a.swa_kv_cache_layout = None
        a.ib_device = ""
        a.gpu_id = 0
        a.system_dp_rank = 0
        a.rust_http_port = None
        a.pp_rank = 0
        a.prefill_start_layer = 0
        a.prefill_end_layer = None
        a.mla_compression_ratios = None
        return a

    def page_bytes(self, pages) -> list[bytes]:
        import torch

        return [t[p * PAGE_SIZE:(p + 1) * PAGE_SIZE].contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes()
                for t in self.k + self.v for p in pages]

    def slot_bytes(self, slot: int) -> list[bytes]:
        import torch

        return [t[i, slot].contiguous().view(torch.uint8).numpy().tobytes()
                for t in (self.conv, self.ssm) for i in range(len(GDN_LAYERS))]

    def aux_bytes(self, row: int) -> bytes:
        return self.aux[row].numpy().tobytes()

    def fill(self, pages, slot: int, value: int) -> None:
        """What a running request the allocator handed these blocks to writes into them."""
        for t in self.k + self.v:
            for p in pages:
                t[p * PAGE_SIZE:(p + 1) * PAGE_SIZE].fill_(value)
        self.conv[:, slot].fill_(value)
        self.ssm[:, slot].fill_(value)

    def zero(self) -> None:
        for t in self.k + self.v + [self.conv, self.ssm, self.aux]:
            t.zero_()

    def named(self, pages, slot: int, aux_row: int) -> dict[tuple, bytes]:
        """Every field of these blocks by global identity (no block ids: position i of
        `pages`), so two ranks of different TP can be compared field by field."""
        import torch

        def raw(t):
            return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()

        out: dict[tuple, bytes] = {}
        heads = kv_heads_of(self.kv_heads, self.tp, self.rank)
        for name, bufs in (("K", self.k), ("V", self.v)):
            for layer, t in zip(ATTN_LAYERS, bufs):
                for i, p in enumerate(pages):
                    page = t[p * PAGE_SIZE:(p + 1) * PAGE_SIZE]
                    for j, h in enumerate(heads):
                        out[(name, layer, "head", h, "page#", i)] = raw(page[:, j])
        at = 0
        for sub, chans in conv_channels_of(self.tp, self.rank):
            for i, layer in enumerate(GDN_LAYERS):
                out[("conv", layer, sub, chans.start, chans.stop)] = raw(self.conv[i, slot, at:at + len(chans)])
            at += len(chans)
        per = V_HEADS // self.tp
        for i, layer in enumerate(GDN_LAYERS):
            for j in range(per):
                out[("ssm", layer, "vhead", self.rank * per + j)] = raw(self.ssm[i, slot, j])
        out[("aux",)] = self.aux_bytes(aux_row)
        return out


def make_pools(seed: int | None, *, tp: int = 1, rank: int = 0, kv_heads: int = KV_HEADS) -> Pools:
    """Rank `rank` of `tp`: its slice of the global state drawn from `seed`; zeros for None."""
    import torch

    if V_HEADS % tp or any(n % tp for n in CONV_GROUPS):
        raise ValueError(f"tp {tp} does not divide the test model's GDN heads")
    g = torch.Generator().manual_seed(seed or 0)
    tokens = (NUM_PAGES + 1) * PAGE_SIZE  # SGLang keeps one padding page
    slots = MAMBA_SLOTS + 1

    def draw(*shape, dtype=torch.bfloat16):
        if seed is None:
            return torch.zeros(*shape, dtype=dtype)
        if dtype is torch.uint8:
            return torch.randint(0, 255, shape, generator=g, dtype=dtype)
        return torch.randn(*shape, generator=g).to(dtype)

    heads = kv_heads_of(kv_heads, tp, rank)
    k = [draw(tokens, kv_heads, HEAD_DIM)[:, heads.start:heads.stop].contiguous() for _ in ATTN_LAYERS]
    v = [draw(tokens, kv_heads, HEAD_DIM)[:, heads.start:heads.stop].contiguous() for _ in ATTN_LAYERS]
    conv_all = draw(len(GDN_LAYERS), slots, sum(CONV_GROUPS), CONV_KERNEL - 1)
    parts, base = [], 0
    for (_, chans), n in zip(conv_channels_of(tp, rank), CONV_GROUPS):
        parts.append(conv_all[:, :, base + chans.start:base + chans.stop])
        base += n
    ssm_all = draw(len(GDN_LAYERS), slots, V_HEADS, HEAD_V, HEAD_K, dtype=torch.float32)
    per = V_HEADS // tp
    return Pools(k=k, v=v, conv=torch.cat(parts, dim=2).contiguous(),
                 ssm=ssm_all[:, :, rank * per:(rank + 1) * per].contiguous(),
                 aux=draw(AUX_ROWS, AUX_ITEM, dtype=torch.uint8), tp=tp, rank=rank, kv_heads=kv_heads)
