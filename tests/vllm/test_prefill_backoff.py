"""The prompt tokens a producer leaves to the decoder, with vLLM 0.33.0's real configs.

GDN/Mamba: one (the decoder needs h(N-1) to compute token N). Multi-module MTP
speculative decoding: its whole lookahead window less one (vLLM's
``num_prefill_lookahead_tokens - 1``, as NixlConnector's ``_prefill_backoff``):
prefilled, the MTP layers would keep unverified drafts in their KV that decode never
rebuilds. Both halves must agree: the producer truncates exactly what the consumer
does not load.
"""

from __future__ import annotations

import json

import pytest

from tests.vllm import harness as h

PROMPT = 100


def connector(tmp_path, role: str, num_speculative_tokens: int | None):
    from vllm.config import SpeculativeConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = json.loads((h.TINY_MODEL / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 3  # Qwen3-Next-style MTP modules
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    vc = h.make_vllm_config(role=role, model=tmp_path)
    kcc = h.make_kv_cache_config(vc)
    if num_speculative_tokens is not None:
        vc.speculative_config = SpeculativeConfig(method="mtp", num_speculative_tokens=num_speculative_tokens,
                                                  target_model_config=vc.model_config,
                                                  target_parallel_config=vc.parallel_config)
    return vc, KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.SCHEDULER, kv_cache_config=kcc)


@pytest.mark.parametrize("spec", [None, 1, 3, 6], ids=["no-spec", "mtp1", "mtp3", "mtp6"])
def test_producer_truncates_exactly_what_the_consumer_does_not_load(tmp_path, spec):
    vc, prod = connector(tmp_path, "kv_producer", spec)
    expected = max(1, vc.num_prefill_lookahead_tokens - 1)  # GDN: at least one
    assert expected == (spec - 1 if spec and spec > 2 else 1)  # the config is what the test means
    req = h.make_request("p1", prompt_len=PROMPT, max_tokens=8, params={"do_remote_decode": True})
    prod.on_new_request(req)
    assert req.num_prompt_tokens == PROMPT - expected
    prod.on_new_request(req)  # preempted and rescheduled: truncated once only
    assert req.num_prompt_tokens == PROMPT - expected

    _, cons = connector(tmp_path, "kv_consumer", spec)
    params = h.remote_prefill_params("d1", groups=4)
    req = h.make_request("d1", prompt_len=PROMPT, max_tokens=8, params=params)
    assert cons.get_num_new_matched_tokens(req, 0) == (PROMPT - expected, True)


def test_a_prompt_logprobs_request_is_not_truncated(tmp_path):
    """Its prompt logprobs need every prompt token computed on the prefill, and vLLM gives it no external
    tokens on decode (skip_reading_prefix_cache), which recomputes it whole, as NixlConnector does."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    _, prod = connector(tmp_path, "kv_producer", None)
    sp = SamplingParams(max_tokens=8, prompt_logprobs=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    req = Request(request_id="p1", prompt_token_ids=list(range(PROMPT)), sampling_params=sp, pooling_params=None)
    assert req.get_skip_reading_prefix_cache()
    prod.on_new_request(req)
    assert req.num_prompt_tokens == PROMPT and len(req.prompt_token_ids) == PROMPT
