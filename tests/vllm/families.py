"""vLLM 0.33.0's real config and KV cache config for one tiny model of each family hybridkv moves.

Like harness.py (whose Qwen3-Next path this extends): a ``VllmConfig`` from a
weightless ``config.json``, the per-layer KV cache specs each family's layers
declare (the same spec classes, fields and values as the model's ``Attention`` /
``MLAAttention`` / ``MambaBase.get_kv_cache_spec``; the state shapes and dtypes from
the model class's own ``get_mamba_state_shape_from_config``), then vLLM's grouping,
tensor planning and ``allocate_kv_cache``. A model has no weights here, so nothing
runs its forward pass: tests write the pages themselves.

Families (``FAMILIES``):
  qwen3.5      Qwen3-Next/Qwen3.5 GDN hybrid, fp32 SSM state (Qwen3.5's ``mamba_ssm_dtype``)
  llama        dense, Llama-shaped
  nemotron_h   Mamba2 hybrid, Nemotron-H-shaped
  deepseek     MLA, DeepSeek-V3-shaped
Options: ``kv_cache_dtype`` ("auto", "fp8", ...), ``mtp`` (Qwen3.5 only: vLLM's MTP speculative
config with that many draft tokens, True: one; the draft layer ``mtp.layers.0.self_attn.attn``), ``kernel_block``
(allocate with attention kernel blocks of that many tokens inside each logical block).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.vllm import harness as h

MODELS = Path(__file__).resolve().parent / "models"
FAMILIES = {
    "qwen3.5": h.TINY_MODEL,
    "llama": MODELS / "llama_tiny",
    "nemotron_h": MODELS / "nemotron_h_tiny",
    "deepseek": MODELS / "deepseek_v3_tiny",
}


def make_config(family: str, *, role: str = "kv_both", kv_cache_dtype: str = "auto", mtp: bool | int = False,
                block_size: int = 16, num_blocks: int = 64, extra: dict[str, Any] | None = None,
                engine_id: str = "engine-test", layout: str | None = None, async_scheduling: bool = False,
                mtp_modules: int = 1):
    """A VllmConfig as ``vllm serve`` builds it for the family's tiny model (harness.make_vllm_config's recipe)."""
    import torch
    from unittest import mock

    from vllm.config import (
        CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig,
    )
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    if mtp and family != "qwen3.5":
        raise ValueError(f"mtp is for qwen3.5 here, got {family!r}")
    model = FAMILIES[family] if mtp_modules == 1 else _with_mtp_modules(FAMILIES[family], mtp_modules)
    mc = ModelConfig(model=str(model), skip_tokenizer_init=True, max_model_len=h.MAX_MODEL_LEN)
    hybrid = family in ("qwen3.5", "nemotron_h")
    cc = CacheConfig(block_size=block_size, mamba_cache_mode="none", enable_prefix_caching=True,
                     num_gpu_blocks_override=num_blocks, cache_dtype=kv_cache_dtype,
                     mamba_ssm_cache_dtype="float32" if family == "qwen3.5" else "auto")
    sc = SchedulerConfig(max_model_len=h.MAX_MODEL_LEN, is_encoder_decoder=False, max_num_seqs=8,
                         max_num_batched_tokens=512, async_scheduling=async_scheduling)
    kvt = KVTransferConfig(kv_connector="HybridKVConnector", kv_connector_module_path="hybridkv.connectors.vllm",
                           kv_role=role, engine_id=engine_id, kv_connector_extra_config=h.with_secret(extra))
    pc = ParallelConfig(tensor_parallel_size=1)
    spec = None
    if mtp:
        spec = SpeculativeConfig(method="mtp", num_speculative_tokens=int(mtp), target_model_config=mc,
                                 target_parallel_config=pc)
    with mock.patch.object(torch.cpu, "_is_avx512_bf16_supported", return_value=False):  # see harness
        vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, kv_transfer_config=kvt,
                        parallel_config=pc, speculative_config=spec)
    vc.scheduler_config.async_scheduling = async_scheduling  # the CPU platform turns it off (see harness)
    if hybrid:
        current_platform._align_hybrid_block_size(vc, FlashAttentionBackend)
    if layout is not None:
        vc.cache_config.kv_cache_layout = layout
    return vc


def _with_mtp_modules(model: Path, n: int) -> Path:
    """The model's config with ``n`` MTP modules (``num_nextn_predict_layers``: vLLM then drafts with one
    module per token, multi-module MTP), in a folder of its own that every test process derives alike."""
    import json
    import tempfile

    cfg = json.loads((model / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = n
    out = Path(tempfile.gettempdir()) / f"hybridkv-tests-{model.name}-mtp{n}"
    out.mkdir(exist_ok=True)
    text = json.dumps(cfg)
    if not (out / "config.json").exists() or (out / "config.json").read_text() != text:
        tmp = out / f"config.json.{__import__('os').getpid()}"
        tmp.write_text(text)
        tmp.replace(out / "config.json")  # atomic: the other side's process may read it now
    return out


def layer_specs(vc, family: str) -> dict[str, Any]:
    """Per-layer specs as the family's layers declare them (see module doc)."""
    import torch
    from vllm.model_executor.layers.attention.attention import kv_cache_dtype_str_to_dtype
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, get_kv_quant_mode

    hf = vc.model_config.hf_text_config
    cache = vc.cache_config
    cache_dtype = cache.cache_dtype
    kv_dtype = kv_cache_dtype_str_to_dtype(cache_dtype, vc.model_config)
    quant = get_kv_quant_mode(cache_dtype)
    specs: dict[str, Any] = {}

    def attention(is_draft: bool = False):
        return FullAttentionSpec(block_size=cache.block_size, num_kv_heads=hf.num_key_value_heads,
                                 head_size=hf.head_dim, dtype=kv_dtype, kv_quant_mode=quant, is_draft=is_draft)

    def state(mamba_type):
        cls, _ = ModelRegistry.resolve_model_cls(vc.model_config.architecture, model_config=vc.model_config)
        return MambaSpec(shapes=tuple(tuple(s) for s in cls.get_mamba_state_shape_from_config(vc)),
                         dtypes=tuple(cls.get_mamba_state_dtype_from_config(vc)), block_size=cache.mamba_block_size,
                         page_size_padded=cache.mamba_page_size_padded, mamba_type=mamba_type,
                         mamba_cache_mode=cache.mamba_cache_mode, num_speculative_blocks=vc.num_speculative_tokens)

    if family == "qwen3.5":
        for i, kind in enumerate(hf.layer_types):
            if kind == "full_attention":
                specs[f"model.layers.{i}.self_attn.attn"] = attention()
            else:
                specs[f"model.layers.{i}.linear_attn"] = state(MambaAttentionBackendEnum.GDN_ATTN)
        if vc.speculative_config is not None:
            # Qwen3NextMTP: its decoder layers are full attention, named under "mtp."
            for j in range(getattr(hf, "num_nextn_predict_layers", 1)):  # Qwen3NextMTP: one per module
                specs[f"mtp.layers.{j}.self_attn.attn"] = attention(is_draft=True)
    elif family == "llama":
        for i in range(hf.num_hidden_layers):
            specs[f"model.layers.{i}.self_attn.attn"] = attention()
    elif family == "nemotron_h":
        for i, kind in enumerate(hf.layers_block_type):
            if kind in ("mamba", "linear_attention"):
                specs[f"model.layers.{i}.mixer"] = state(MambaAttentionBackendEnum.MAMBA2)
            elif kind in ("attention", "full_attention"):
                specs[f"model.layers.{i}.mixer.attn"] = attention()
    elif family == "deepseek":
        for i in range(hf.num_hidden_layers):
            specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
                block_size=cache.block_size, num_kv_heads=1, max_tp_shards=1,
                head_size=hf.kv_lora_rank + hf.qk_rope_head_dim, dtype=kv_dtype, cache_dtype_str=cache_dtype,
                kv_quant_mode=quant)
    else:
        raise ValueError(f"family {family!r}; expected one of {sorted(FAMILIES)}")
    del torch
    return specs


def make_kv_cache_config(vc, family: str):
    """vLLM's layout resolution, grouping and tensor planning (the harness's and the bench's recipe)."""
    from hybridkv.benchmarks.vllm_model import plan_kv_cache

    return plan_kv_cache(vc, layer_specs(vc, family))


def allocate(vc, kcc, *, kernel_block: int | None = None):
    """The tensors vLLM's ``allocate_kv_cache`` makes (kernel blocks of ``kernel_block`` tokens in token groups)."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    kernel = None
    if kernel_block is not None:
        kernel = [None if isinstance(g.kv_cache_spec, MambaSpec) else kernel_block for g in kcc.kv_cache_groups]
    return allocate_kv_cache(kcc, torch.device("cpu"), vc.cache_config.get_resolved_kv_cache_layout(), kernel)


#: What the family tests start and move: (family, options). MTP and fp8 on Qwen3.5 as operators run it.
CASES: dict[str, dict[str, Any]] = {
    "qwen3.5-bf16": {"family": "qwen3.5"},
    "qwen3.5-fp8": {"family": "qwen3.5", "kv_cache_dtype": "fp8"},
    "qwen3.5-mtp-bf16": {"family": "qwen3.5", "mtp": True},
    "qwen3.5-mtp-fp8": {"family": "qwen3.5", "mtp": True, "kv_cache_dtype": "fp8"},
    "llama": {"family": "llama"},
    "llama-kernel-blocks": {"family": "llama", "block_size": 32, "kernel_block": 16, "layout": "LBHNC"},
    "nemotron_h": {"family": "nemotron_h"},
    "deepseek-mla": {"family": "deepseek"},
}


def build(case: str, *, role: str, engine_id: str, extra: dict[str, Any] | None = None, **overrides: Any):
    """(vllm config, KV cache config, tensors) of a case, as vLLM makes them; ``overrides``: make_config
    options over the case's (e.g. ``mtp=2`` draft tokens, ``async_scheduling``)."""
    vc, kcc = config(case, role=role, engine_id=engine_id, extra=extra, **overrides)
    return vc, kcc, allocate(vc, kcc, kernel_block={**CASES[case], **overrides}.get("kernel_block"))


def config(case: str, *, role: str, engine_id: str = "engine-test", extra: dict[str, Any] | None = None,
           **overrides: Any):
    """(vllm config, KV cache config) of a case with make_config ``overrides``, nothing allocated."""
    opts = {**CASES[case], **overrides}
    family = opts.pop("family")
    opts.pop("kernel_block", None)
    vc = make_config(family, role=role, engine_id=engine_id, extra=extra, **opts)
    return vc, make_kv_cache_config(vc, family)


def worker(vc, kcc, kv):
    """A worker-role HybridKVConnector from vLLM's factory, registered with ``kv``."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    conn = KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.WORKER, kv_cache_config=kcc)
    conn.register_kv_caches(kv)
    return conn


def request_blocks(kcc, *, tokens: int, first: int) -> tuple[tuple[int, ...], ...]:
    """Block ids a request of ``tokens`` tokens holds in each transfer group, from ``first`` on: distinct
    across groups (vLLM's groups share one pool); a state group holds one (its running state)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    out, at = [], first
    for g in kcc.transfer_groups:
        n = 1 if isinstance(g.kv_cache_spec, MambaSpec) else -(-tokens // g.kv_cache_spec.block_size)
        out.append(tuple(range(at, at + n)))
        at += n
    if at > kcc.num_blocks:
        raise ValueError(f"{at} blocks needed, the pool has {kcc.num_blocks}")
    return tuple(out)


def _pages(kv, kcc, name):
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    return group_kernel_blocks(kv[name], kcc.num_blocks)  # logical blocks first, kernel blocks inside


def fill(kv, kcc, blocks, *, seed: int) -> None:
    """Random bytes in every layer's page of ``blocks`` (what a prefill's forward pass leaves there)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for g, ids in zip(kcc.transfer_groups, blocks):
        for name in g.layer_names:
            pages = _pages(kv, kcc, name)
            for b in ids:
                page = pages[b]
                rnd = torch.randint(-128, 128, (page.numel() * page.element_size(),), dtype=torch.int8, generator=gen)
                page.copy_(rnd.view(page.dtype).view(page.shape))


def read(kv, kcc, blocks) -> dict[str, list[bytes]]:
    """Each layer's page bytes of ``blocks`` (per transfer group), layer by layer."""
    import torch

    out: dict[str, list[bytes]] = {}
    for g, ids in zip(kcc.transfer_groups, blocks):
        for name in g.layer_names:
            pages = _pages(kv, kcc, name)
            out[name] = [pages[b].contiguous().view(-1).view(torch.uint8).numpy().tobytes() for b in ids]
    return out
