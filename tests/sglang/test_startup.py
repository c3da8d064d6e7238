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


@pytest.mark.slow
def test_real_managers_refuse_to_start_without_a_secret_once_hybridkv_requires_one(rank):
    """With hybridkv's secure-by-default gates on (transport.config.REQUIRE_SECRET, transport.auth.STRICT_SECRETS:
    the default; turned on here explicitly all the same), a manager without a secret stops, naming the secret settings and the
    lab-mode opt-in; lab mode by name (as this test harness runs every rank without a secret) and the harness's
    secret (hex of 32 random bytes) both start."""
    before = rank.call("secure_gates", True)
    try:
        for role in ("prefill", "decode"):
            started = rank.call("start_manager", (role, {"HYBRIDKV_SGLANG_INSECURE_NO_AUTH": "0"}))
            assert "no shared secret (HYBRIDKV_SGLANG_SECRET_FILE or HYBRIDKV_SGLANG_SECRET_ENV)" in started["error"]
            assert "HYBRIDKV_SGLANG_INSECURE_NO_AUTH=1" in started["error"], started
        assert rank.call("start_manager", ("decode", {"HYBRIDKV_SGLANG_INSECURE_NO_AUTH": "1"}))["error"] is None
        assert rank.call("start_manager", ("decode", dict(pd_peer.SECRET_ENV)))["error"] is None
    finally:
        rank.call("secure_gates", all(before))


@pytest.mark.slow
def test_real_managers_with_a_secret_on_host_memory_refuse_naming_the_opt_in(rank):
    """These ranks' pools are host memory (CPU; SGLang's metadata buffers are host memory on GPU servers too): with a
    secret and UCX free to pick tcp, shm or cma, which do not bound a peer to the registration, a manager stops
    before its NIXL agent exists, naming UCX_TLS and HYBRIDKV_SGLANG_INSECURE_HOST_MEMORY=1; with the opt-in it
    starts (the harness's setting)."""
    bare = {**pd_peer.SECRET_ENV, "HYBRIDKV_SGLANG_INSECURE_HOST_MEMORY": "0"}
    for role in ("prefill", "decode"):
        started = rank.call("start_manager", (role, bare))
        assert "host-memory KV cache with a shared secret" in started["error"], started
        assert "UCX_TLS=rc,cuda_ipc" in started["error"], started
        assert "HYBRIDKV_SGLANG_INSECURE_HOST_MEMORY=1" in started["error"], started
    assert rank.call("start_manager", ("decode", dict(pd_peer.SECRET_ENV)))["error"] is None


@pytest.mark.slow
def test_nic_binding_and_nixl_backend_params_reach_nixl(rank):
    """As SGLang's NIXL backend takes them: SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS and 8 UCX threads on a
    prefill rank (none on a decode rank) are what NIXL's UCX backend was created with (NIXL's own
    get_backend_params of the real agent); --disaggregation-ib-device naming a NIC this machine lacks reaches
    NIXL's backend creation as UCX's device_list, which fails there, naming it; another backend is refused."""
    env = {"SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS": '{"num_workers": "2"}'}
    started = rank.call("start_manager", ("prefill", env, 1, 1, None, ""))
    assert started["error"] is None, started
    assert started["ucx"] == {"ucx_error_handling_mode": "peer", "num_workers": "2", "num_threads": "8"}
    started = rank.call("start_manager", ("decode", env, 1, 1, None, ""))
    assert started["ucx"] == {"ucx_error_handling_mode": "peer", "num_workers": "2"}, started
    started = rank.call("start_manager", ("decode", {}, 1, 1, None, '{"0": "hkv_no_such_nic0", "1": "mlx5_1"}'))
    assert "NIXL could not start its UCX backend" in started["error"], started
    assert "'device_list': 'hkv_no_such_nic0'" in started["error"], started
    started = rank.call("start_manager", ("decode", {"SGLANG_DISAGGREGATION_NIXL_BACKEND": "UCCL"}))
    assert "SGLANG_DISAGGREGATION_NIXL_BACKEND='UCCL'" in started["error"] and "expected UCX" in started["error"]
