"""The analyzer's ``vllm-0.33`` scheme against vLLM 0.33.0's own NixlConnector code, same config.

NixlConnector's worker cannot be constructed on CPU (it needs a NIXL agent of
vLLM's own import and a distributed group), so we build the state its
``register_kv_caches`` computes from the tensors vLLM allocates in the layout it
forces (LBHNC), following its rules (one region per distinct base address; a
region holding a Mamba layer is an SSM region; GDN conv split from vLLM's own
``derive_mamba_conv_split``), and run its real ``_compute_desc_ids`` and
``_logical_to_kernel_block_ids`` on a request's block lists. The number of
descriptor ids it hands to ``make_prepped_xfer`` must equal the analyzer's count.
"""

from __future__ import annotations

import pytest

from tests.vllm import harness as h


def _request_blocks(kcc, tokens: int, block_size: int):
    """One request's clipped block lists: every attention block, one state block per GDN group."""
    from vllm.v1.kv_cache_interface import MambaSpec

    n = -(-tokens // block_size)
    nxt = iter(range(1, kcc.num_blocks))
    return tuple([next(nxt)] if isinstance(g.kv_cache_spec, MambaSpec) else [next(nxt) for _ in range(n)]
                 for g in kcc.transfer_groups)


@pytest.mark.parametrize("ssm_dtype", ["auto", "float32"])  # float32: Qwen3.5's GDN state
@pytest.mark.parametrize("tokens", [99, 500])
@pytest.mark.parametrize("kernel_block", [None, 16])
def test_analyzer_vllm_033_count_matches_nixl_connector(tokens, kernel_block, ssm_dtype):
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybridkv.descriptors.schemes import Scheme, Workload, count_descriptors
    from hybridkv.layout.hf_config import load_hf_config

    vc = h.make_vllm_config(role="kv_consumer", num_blocks=64, ssm_dtype=ssm_dtype)
    vc.cache_config.kv_cache_layout = "LBHNC"  # what NixlConnector.get_required_kvcache_layout forces
    kcc = h.make_kv_cache_config(vc)
    block = vc.cache_config.block_size
    ppl = 1 if kernel_block is None else block // kernel_block
    kv = allocate_kv_cache(kcc, torch.device("cpu"), vc.cache_config.get_resolved_kv_cache_layout(), None)
    state = h.nixl_connector_state(vc, kcc, kv, ppl)
    logical = _request_blocks(kcc, tokens, block)
    physical = NixlBaseConnectorWorker._logical_to_kernel_block_ids(state, logical, ppl)
    ids = NixlBaseConnectorWorker._compute_desc_ids(
        state, physical, dst_num_blocks=kcc.num_blocks * ppl, block_size_ratio=None,
        physical_blocks_per_logical=ppl)
    vllm_count = len(ids)

    ssm_dtype = str(next(g.kv_cache_spec.dtypes[-1] for g in kcc.kv_cache_groups
                         if hasattr(g.kv_cache_spec, "dtypes"))).removeprefix("torch.")
    geometry = load_hf_config(h.TINY_MODEL, ssm_dtype=ssm_dtype)
    w = Workload(geometry=geometry, tokens=tokens, kernel_block_size=kernel_block)
    assert w.effective_block_size == block, "hybridkv's HMA alignment disagrees with vLLM's"
    model = count_descriptors(Scheme.VLLM_033, w)
    assert model.regions == state.num_regions
    assert model.descriptors == vllm_count, (
        f"analyzer vllm-0.33 says {model.descriptors}, vLLM's NixlConnector code builds {vllm_count}")
