"""What every KV-cache layer of a vLLM 0.33 engine holds, read from its ``KVCacheConfig`` alone.

vLLM decides the cache: one spec per group (block size, heads, head size, dtype
incl. fp8, Mamba state shapes and dtypes, page bytes) and the layer names in each
group, draft (MTP/EAGLE) layers included. This module turns that into a hybridkv
:class:`~hybridkv.layout.ModelGeometry` (one layer per KV-cache layer name, in a
canonical order both sides of a transfer share) and the groups' specs, without
reading the Hugging Face config. Layers are identified by their names: a draft
layer ``mtp.layers.0.self_attn.attn`` is its own layer, never ``layers.0``.

The geometry is unsharded (as hybridkv's layouts want it): vLLM's specs are one TP
rank's, so heads are multiplied back by the TP size (a replicated MLA latent stays
one head). What hybridkv cannot move is refused here, naming the layer, its spec and
why; the connector calls this when vLLM constructs it, before any tensor is
allocated or request served.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridkv.ids import GroupId
from hybridkv.layout import GroupSpec, LayerSpec, ModelGeometry
from hybridkv.layout.geometry import AttentionSpec, DType, GDNSpec, StateSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec


class UnsupportedKVCache(ValueError):
    """vLLM's KV cache holds something hybridkv cannot move; the message says what and why."""


@dataclass(frozen=True, kw_only=True)
class AdoptedSpecs:
    """The KV cache vLLM decided, as hybridkv sees it."""

    geometry: ModelGeometry  # unsharded; layer i is layer_names[i]
    layer_names: tuple[str, ...]
    groups: tuple[GroupSpec, ...]  # the transfer groups, group_id = vLLM's group index
    #: vLLM layer name -> vLLM's own spec of that layer (the group's, or its entry in a uniform-type group)
    vllm_specs: Mapping[str, Any]
    group_of: Mapping[str, int]
    #: layers vLLM marks as a draft model's, or named outside the target model (MTP heads)
    draft_layers: frozenset[str]

    def layer_index(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise ValueError(f"KV cache layer {name!r} is in no transfer group of vLLM's KVCacheConfig") from None

    @property
    def _index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.layer_names)}

    def describe(self) -> str:
        """One line per group: what an operator reads in the start-up log."""
        out = []
        for g in self.groups:
            names = [self.layer_names[i] for i in g.layer_indices]
            spec = self.geometry.layers[g.layer_indices[0]]
            draft = sum(n in self.draft_layers for n in names)
            out.append(f"group {int(g.group_id)}: {type(self.vllm_specs[names[0]]).__name__} -> {spec.kind.value}, "
                       f"{len(names)} layer(s){f' ({draft} draft)' if draft else ''}, "
                       f"{g.block_tokens or 'state'} tokens/block, dtypes {[d.value for d in spec.dtypes]}")
        return "; ".join(out)


_NUMBER = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple:
    """Layer names in reading order (``layers.2`` before ``layers.10``): both sides of a transfer number
    the same layers the same way, whatever order vLLM lists them in."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in _NUMBER.split(name) if p)


def adopt_specs(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, tp: int | None = None) -> AdoptedSpecs:
    """hybridkv's view of ``kv_cache_config``; raises :class:`UnsupportedKVCache` for what it cannot move."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    tp = vllm_config.parallel_config.tensor_parallel_size if tp is None else tp
    model = str(vllm_config.model_config.model)
    groups = kv_cache_config.kv_cache_groups
    transfer = tuple(kv_cache_config.transfer_group_ids)
    if not transfer:
        raise UnsupportedKVCache(f"model {model!r} has no KV cache group to transfer (vLLM's KVCacheConfig has "
                                 f"{len(groups)} group(s), none with enable_kv_transfer): nothing for a P/D "
                                 "connector to move")
    vllm_specs: dict[str, Any] = {}
    group_of: dict[str, int] = {}
    for gid in transfer:
        group = groups[gid]
        if getattr(group, "host_resident", False):
            raise UnsupportedKVCache(f"model {model!r}: KV cache group {gid} lives in host memory (HiSparse); "
                                     "hybridkv moves device-resident groups only")
        spec = group.kv_cache_spec
        for name in group.layer_names:
            vllm_specs[name] = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
            group_of[name] = gid
    names = tuple(sorted(vllm_specs, key=natural_key))
    draft = frozenset(n for n in names if getattr(vllm_specs[n], "is_draft", False) or not _in_target(n))
    ctx = _Context(vllm_config=vllm_config, tp=tp, model=model)
    layers = tuple(_layer_spec(ctx, n, vllm_specs[n], draft=n in draft) for n in names)
    index = {n: i for i, n in enumerate(names)}
    out_groups = []
    for gid in transfer:
        group = groups[gid]
        if not group.layer_names:
            raise UnsupportedKVCache(f"model {model!r}: KV cache group {gid} holds no layers")
        specs = {layers[index[n]].kind for n in group.layer_names}
        if len(specs) != 1:
            raise UnsupportedKVCache(f"model {model!r}: KV cache group {gid} mixes layer kinds "
                                     f"{sorted(k.value for k in specs)}; expected one kind per group")
        first = layers[index[group.layer_names[0]]]
        out_groups.append(GroupSpec(group_id=GroupId(gid), kind=first.kind,
                                    layer_indices=tuple(index[n] for n in group.layer_names),
                                    block_tokens=first.block_tokens(int(group.kv_cache_spec.block_size))))
    geometry = ModelGeometry(name=model, layers=layers)
    return AdoptedSpecs(geometry=geometry, layer_names=names, groups=tuple(out_groups), vllm_specs=vllm_specs,
                        group_of=group_of, draft_layers=draft)


def _in_target(name: str) -> bool:
    """A layer of the target model (``model.layers.3...``, ``language_model.model.layers.3...``) rather
    than of a draft head vLLM attaches beside it (``mtp.layers.0...``, ``draft_model...``)."""
    head = name.split(".", 1)[0]
    return head not in ("mtp", "draft_model", "drafter", "eagle", "speculator")


@dataclass(frozen=True, kw_only=True)
class _Context:
    vllm_config: Any
    tp: int
    model: str

    def refuse(self, name: str, spec: Any, why: str) -> UnsupportedKVCache:
        return UnsupportedKVCache(f"model {self.model!r}: KV cache layer {name!r} is vLLM's {type(spec).__name__}; "
                                  f"hybridkv cannot move it: {why}")


_TORCH_DTYPES: dict[str, DType] = {
    "torch.float32": DType.FLOAT32, "torch.bfloat16": DType.BFLOAT16, "torch.float16": DType.FLOAT16,
    "torch.float8_e4m3fn": DType.FLOAT8_E4M3, "torch.float8_e5m2": DType.FLOAT8_E5M2,
    "torch.uint8": DType.UINT8, "torch.int8": DType.INT8,
}


def _dtype(ctx: _Context, name: str, spec: Any, dtype: Any) -> DType:
    got = _TORCH_DTYPES.get(str(dtype))
    if got is None:
        raise ctx.refuse(name, spec, f"its dtype {dtype} is none of {sorted(_TORCH_DTYPES)}")
    return got


def _layer_spec(ctx: _Context, name: str, spec: KVCacheSpec, *, draft: bool) -> LayerSpec:
    from vllm.v1.kv_cache_interface import AttentionSpec as VllmAttention
    from vllm.v1.kv_cache_interface import MambaSpec

    if isinstance(spec, MambaSpec):
        return _state_spec(ctx, name, spec)
    if isinstance(spec, VllmAttention):
        return _attention_spec(ctx, name, spec, draft=draft)
    raise ctx.refuse(name, spec, "hybridkv knows vLLM's attention (full, sliding window, chunked local, MLA) "
                                 "and Mamba-type state specs only")


def _attention_classes() -> dict[type, str]:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec, FullAttentionSpec, MLAAttentionSpec, SlidingWindowMLASpec, SlidingWindowSpec,
    )

    return {FullAttentionSpec: "full", MLAAttentionSpec: "full", SlidingWindowSpec: "sliding",
            SlidingWindowMLASpec: "sliding", ChunkedLocalAttentionSpec: "chunked"}


def _attention_spec(ctx: _Context, name: str, spec: Any, *, draft: bool) -> AttentionSpec:
    window_kind = _attention_classes().get(type(spec))
    if window_kind is None:
        why = {"CrossAttentionSpec": "an encoder-decoder's cross-attention cache holds the encoder's output, "
                                     "which the decode side computes from the request itself",
               "EncoderOnlyAttentionSpec": "an encoder-only layer keeps no cache"}.get(
            type(spec).__name__, "its pages are laid out in a way hybridkv does not know (only FullAttentionSpec, "
                                 "MLAAttentionSpec, SlidingWindowSpec, SlidingWindowMLASpec and "
                                 "ChunkedLocalAttentionSpec are)")
        raise ctx.refuse(name, spec, why)
    if spec.tokens_per_state != 1:
        raise ctx.refuse(name, spec, f"it stores one state per {spec.tokens_per_state} tokens (compressed "
                                     "attention); hybridkv splits pages by tokens")
    if spec.num_head_slots is not None and spec.num_head_slots != spec.num_kv_heads:
        raise ctx.refuse(name, spec, f"its kv-cache dtype packs {spec.num_kv_heads} heads into "
                                     f"{spec.num_head_slots} slots")
    dcp = getattr(ctx.vllm_config.parallel_config, "decode_context_parallel_size", 1)
    if spec.dcp_sharded and dcp > 1:
        raise ctx.refuse(name, spec, f"decode context parallelism ({dcp}) shards its tokens across ranks")
    dtype = _dtype(ctx, name, spec, spec.dtype)
    head_v = 0 if spec.head_size_v == 0 else (None if spec.head_size_v == spec.head_size else spec.head_size_v)
    dense = (spec.head_size + spec.head_size_v) * dtype.itemsize
    content = int(spec.state_content_size_bytes)
    encoding = None
    if int(spec.kv_quant_mode) != 0:
        encoding = getattr(spec, "cache_dtype_str", None) or str(ctx.vllm_config.cache_config.cache_dtype)
    window: int | None = None
    if window_kind == "sliding":
        window = int(spec.sliding_window)
    elif window_kind == "chunked":
        window = int(spec.attention_chunk_size)
    # Without the hybrid allocator vLLM files sliding-window layers under FullAttentionSpec and keeps
    # every block: they move as full attention.
    return AttentionSpec.windowed(
        window=window, chunked=window_kind == "chunked",
        num_kv_heads=_total_heads(ctx, spec, draft=draft), head_dim=int(spec.head_size), dtype=dtype,
        head_dim_v=head_v, head_token_bytes=None if content == dense else content, encoding=encoding)


def _total_heads(ctx: _Context, spec: Any, *, draft: bool) -> int:
    """The model's KV heads from one rank's: times TP, except where ranks hold replicas."""
    per_rank, tp = int(spec.num_kv_heads), ctx.tp
    shards = getattr(spec, "max_tp_shards", None)
    if shards is not None:
        return per_rank * min(tp, shards)
    if per_rank == 1 and tp > 1:
        # Fewer KV heads than ranks: vLLM replicates one head per rank; the model's count says how many.
        total = _model_kv_heads(ctx.vllm_config, draft=draft)
        if total is not None and total < tp and tp % total == 0:
            return total
    return per_rank * tp


def _model_kv_heads(vllm_config: Any, *, draft: bool) -> int | None:
    config = vllm_config.model_config
    if draft:
        spec_config = getattr(vllm_config, "speculative_config", None)
        config = getattr(spec_config, "draft_model_config", None) or config
    try:
        return int(config.get_total_num_kv_heads())
    except Exception:  # a config without attention heads: no hint
        return None


def _state_spec(ctx: _Context, name: str, spec: Any) -> LayerSpec:
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    shapes = tuple(tuple(int(d) for d in s) for s in spec.shapes)
    dtypes = tuple(_dtype(ctx, name, spec, d) for d in spec.dtypes)
    family = str(getattr(spec.mamba_type, "name", spec.mamba_type)).lower()
    if spec.mamba_type == MambaAttentionBackendEnum.GDN_ATTN and not spec.tp_replicated:
        gdn = _gdn(ctx, name, spec, shapes, dtypes)
        if gdn is not None:
            return gdn
    return StateSpec(shapes=shapes, state_dtypes=dtypes, taken_tp=ctx.tp, replicated=bool(spec.tp_replicated),
                     family=family)


def _gdn(ctx: _Context, name: str, spec: Any, shapes, dtypes) -> GDNSpec | None:
    """GDN's heads from its state shapes: conv (conv_dim / tp, kernel - 1 [+ speculative tokens]) in the DS
    layout and SSM (value heads / tp, dv, dk); conv_dim = 2 * k_heads * dk + v_heads * dv."""
    from hybridkv.connectors.vllm.layout_adopt import conv_layout_is_ds

    if not conv_layout_is_ds():
        raise ctx.refuse(name, spec, "the GDN conv state is in the SD layout; hybridkv moves it per TP sub-block and "
                                     "needs DS: start vLLM with VLLM_SSM_CONV_STATE_LAYOUT=DS on both prefill and "
                                     "decode")
    if len(shapes) != 2 or len(shapes[0]) != 2 or len(shapes[1]) != 3:
        return None
    (conv_dim, state_len), (v_heads, dv, dk) = shapes
    k_part = conv_dim - v_heads * dv
    if k_part <= 0 or k_part % (2 * dk):
        return None
    try:
        return GDNSpec(num_k_heads=k_part // (2 * dk) * ctx.tp, num_v_heads=v_heads * ctx.tp, head_k_dim=dk,
                       head_v_dim=dv, conv_kernel=state_len + 1, conv_dtype=dtypes[0], ssm_dtype=dtypes[1])
    except ValueError:
        return None  # not GDN's head structure after all: moved whole


def compat_fields(vllm_config: VllmConfig) -> dict[str, str]:
    """What both sides of a transfer must agree on beyond the layout tables (which already carry every
    layer's dtypes, heads and state shapes): the model, the kv-cache dtype as configured (fp8_e4m3 and
    fp8_e5m2 share a storage type), the speculative config (a draft layer's KV is only meaningful to the
    same drafter) and hybridkv's version. Block sizes and the TP size may differ: hybridkv pairs those by
    fields. Sent in the transport's authenticated handshake; a pair that differs is refused there."""
    import hashlib

    import hybridkv

    def short(value: str) -> str:
        return value if len(value) <= 128 else hashlib.sha256(value.encode()).hexdigest()[:32]

    mc = vllm_config.model_config
    spec = getattr(vllm_config, "speculative_config", None)
    speculative = "none"
    if spec is not None:
        draft = getattr(spec, "draft_model_config", None)
        speculative = (f"{spec.method}:{spec.num_speculative_tokens}:"
                       f"{getattr(draft, 'model', None)}:{getattr(spec, 'kv_cache_dtype', None)}")
    return {
        "vllm.model": short(f"{mc.model}@{getattr(mc, 'revision', None)}"),
        "vllm.kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "vllm.speculative": short(speculative),
        "hybridkv.version": str(hybridkv.__version__),
    }


__all__ = ["AdoptedSpecs", "UnsupportedKVCache", "adopt_specs", "compat_fields", "natural_key"]
