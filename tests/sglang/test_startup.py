"""What the SGLang backend refuses or settles before a manager starts
(connectors/sglang/startup.py): unit checks here, and the real managers built as
SGLang's scheduler builds them, in a rank process with SGLang's runtime context,
stopping with the message (PP, a state type it does not move, a drain timeout
SGLang would cut short)."""

from __future__ import annotations

import pytest

from hybridkv.connectors.sglang.config import SGLangConfig
from hybridkv.connectors.sglang.startup import MOVED_STATE_TYPES, check_parallel, check_state_types, drain_timeout
from tests.sglang import pd_peer

DEFERRED_TIMEOUT = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
DEFERRED = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
DRAIN = "HYBRIDKV_SGLANG_DRAIN_TIMEOUT_S"


def test_every_state_type_sglang_nixl_moves_is_moved_but_dsa_tail():
    from sglang.srt.disaggregation.base.conn import StateType

    assert {st.value for st in StateType} - MOVED_STATE_TYPES == {"dsa_tail"}
    check_state_types([st for st in StateType if st is not StateType.DSA_TAIL])
    with pytest.raises(ValueError, match=r"state type 'dsa_tail' is not supported: its indices are a \(slot, "):
        check_state_types([StateType.MAMBA, StateType.DSA_TAIL])
    with pytest.raises(ValueError, match="state type 'future_state' is not supported: hybridkv does not know"):
        check_state_types(["future_state"])


def test_pipeline_and_context_parallel_are_refused_naming_the_size():
    check_parallel(pp_size=1, attn_cp_size=1, role="prefill")
    with pytest.raises(ValueError, match=r"pipeline parallelism is not supported \(prefill --pp-size 2\)"):
        check_parallel(pp_size=2, attn_cp_size=1, role="prefill")
    with pytest.raises(ValueError, match="attention context parallelism is not supported .decode attention CP "
                                         "size 2"):
        check_parallel(pp_size=1, attn_cp_size=2, role="decode")


@pytest.mark.parametrize("drain, deferred, tp, want", [
    (None, True, 2, 30.0),  # unset: SGLang's deferred release timeout
    (None, True, 1, 30.0),
    (20.0, True, 2, 20.0),  # shorter: hybridkv releases first, SGLang follows
    (30.0, True, 2, 30.0),
    (None, False, 1, 300.0),  # no deferred release at TP 1: the receiver holds; SGLang's waiting timeout
    (120.0, False, 1, 120.0),
])
def test_decode_drain_timeout_follows_sglang_deferred_release(drain, deferred, tp, want):
    cfg = SGLangConfig(drain_timeout_s=drain)
    assert drain_timeout(cfg, decode=True, waiting_timeout=300, deferred_release=deferred, deferred_timeout=30.0,
                         attn_tp_size=tp) == want


def test_decode_drain_timeout_sglang_would_cut_short_is_refused():
    with pytest.raises(ValueError, match=rf"{DRAIN}=300 is longer than {DEFERRED_TIMEOUT}=30: SGLang would free a "
                                         rf"held request's pages .* expected {DRAIN} <= 30"):
        drain_timeout(SGLangConfig(drain_timeout_s=300.0), decode=True, waiting_timeout=300, deferred_release=True,
                      deferred_timeout=30.0, attn_tp_size=1)
    with pytest.raises(ValueError, match=rf"{DEFERRED} is off at decode attention TP 2"):
        drain_timeout(SGLangConfig(), decode=True, waiting_timeout=300, deferred_release=False, deferred_timeout=30.0,
                      attn_tp_size=2)
    # A prefill has no deferred release: its drain timeout only sizes its lease.
    assert drain_timeout(SGLangConfig(drain_timeout_s=300.0), decode=False, waiting_timeout=None,
                         deferred_release=True, deferred_timeout=30.0, attn_tp_size=1) == 300.0


@pytest.fixture(scope="module")
def rank():
    r = pd_peer.Rank()
    yield r
    r.close()


@pytest.mark.slow
def test_real_managers_refuse_at_start_up_naming_the_setting(rank):
    started = rank.call("start_manager", ("prefill", {}, 1, 2))
    assert "pipeline parallelism is not supported (prefill --pp-size 2)" in started["error"], started
    started = rank.call("start_manager", ("decode", {}, 1, 2))
    assert "pipeline parallelism is not supported (decode --pp-size 2)" in started["error"], started
    started = rank.call("start_manager", ("prefill", {}, 1, 1, "dsa_tail"))
    assert "state type 'dsa_tail' is not supported" in started["error"], started
    started = rank.call("start_manager", ("decode", {DRAIN: "300", DEFERRED_TIMEOUT: "30"}, 2))
    assert f"{DRAIN}=300 is longer than {DEFERRED_TIMEOUT}=30" in started["error"], started
    started = rank.call("start_manager", ("decode", {DEFERRED: "0"}, 2))
    assert f"{DEFERRED} is off at decode attention TP 2" in started["error"], started


@pytest.mark.slow
def test_real_decode_manager_takes_sglang_deferred_release_timeout(rank):
    assert rank.call("start_manager", ("decode", {}, 2)) == dict(error=None, drain_timeout_s=30.0)
    assert rank.call("start_manager", ("decode", {DEFERRED_TIMEOUT: "45"}, 2)) == dict(error=None,
                                                                                       drain_timeout_s=45.0)
    assert rank.call("start_manager", ("decode", {DRAIN: "12"}, 2)) == dict(error=None, drain_timeout_s=12.0)
