"""A decode dials only the producers its operator allowed (`allowed_producers`), never simply the host a
request's kv_transfer_params name: vLLM accepts those from a client's request body, so otherwise any client
could make the decode dial any host (issue 48). A request naming another producer fails into
kv_load_failure_policy, before any connection, with the address in the error; an allowed one is dialled."""

from __future__ import annotations

import socket

import pytest

from tests.ports import free_ports
from tests.vllm import harness as h


def _decode_with(allowed: list[str] | None, listener: socket.socket):
    from vllm.v1.engine import FinishReason

    extra = {"allowed_producers": allowed} if allowed is not None else {}
    vc = h.make_vllm_config(role="kv_consumer", policy="recompute", engine_id="decode-engine", extra=extra)
    kcc = h.make_kv_cache_config(vc)
    sched, conn, runner, d = h.real_decode(vc, kcc, async_scheduling=False)
    params = h.remote_prefill_params("d1", groups=len(kcc.transfer_group_ids))
    # A client's body names this host: a plain TCP listener that counts who connects (it never answers).
    params["remote_host"], params["remote_port"] = listener.getsockname()
    sched.add_request(h.make_request("d1", prompt_len=100, max_tokens=2, params=params))
    try:
        d.run_for(60, until=lambda: "d1" in d.finished)
        assert d.finished["d1"][0] is FinishReason.LENGTH  # recomputed locally either way
        return runner.failed, dict(conn.worker.load_errors)
    finally:
        conn.shutdown()


def _count_dials(listener: socket.socket, dials: list[int]) -> None:
    """Accept and close at once: a dial is counted, and the decode's handshake fails fast."""
    listener.settimeout(0.2)
    while listener.fileno() != -1:
        try:
            c, _ = listener.accept()
        except (TimeoutError, socket.timeout):
            continue
        except OSError:
            return
        dials.append(1)
        c.close()


@pytest.mark.parametrize("allowed, dials", [(["10.0.0.0/8"], False), (["127.0.0.0/8"], True)],
                         ids=["outside-not-dialled", "inside-dialled"])
def test_a_request_naming_a_producer_outside_allowed_producers_is_not_dialled(allowed, dials):
    import threading

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", free_ports()))
        listener.listen(8)
        seen: list[int] = []
        counter = threading.Thread(target=_count_dials, args=(listener, seen), daemon=True)
        counter.start()
        failed, errors = _decode_with(allowed, listener)
        listener.close()
        counter.join(5)
        assert failed == {"d1"}
        assert bool(seen) is dials
        if not dials:
            assert "not in allowed_producers" in errors["d1"] and "127.0.0.1" in errors["d1"], errors


def test_allowed_producers_is_checked_at_start_up():
    from hybridkv.connectors.vllm.config import HybridKVVllmConfig

    assert HybridKVVllmConfig.from_extra_config({"allowed_producers": "10.0.0.0/8, 127.0.0.1"},
                                                env={}).allowed_producers == ("10.0.0.0/8", "127.0.0.1")
    with pytest.raises(ValueError, match="allowed_producers.*'prefill-0'.*not an IP address"):
        HybridKVVllmConfig.from_extra_config({"allowed_producers": ["prefill-0"]}, env={})
