"""The shared secret, the handshake's proofs and request capabilities (hybridkv.transport.auth)."""

from __future__ import annotations

import pytest

from hybridkv import wire
from hybridkv.transport import auth
from hybridkv.transport.config import TransportConfig

SECRET = b"0123456789abcdef0123"


def test_the_secret_comes_from_a_file_or_an_environment_variable(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")  # as `echo` or `base64` write it
    assert auth.load_secret(file=path) == SECRET
    monkeypatch.setenv("HKV_SECRET", SECRET.decode())
    assert auth.load_secret(env="HKV_SECRET") == SECRET


@pytest.mark.parametrize(("kw", "message"), [
    ({}, "expected exactly one of the two"),
    ({"file": "/a", "env": "B"}, "expected exactly one of the two"),
    ({"file": "/nonexistent/hkv"}, r"secret file '/nonexistent/hkv' cannot be read"),
    ({"env": "HKV_UNSET"}, r"environment variable 'HKV_UNSET' is not set"),
    ({"env": "HKV_SHORT"}, r"environment variable 'HKV_SHORT' has 5 bytes; expected at least 16"),
])
def test_an_unusable_secret_is_named(kw, message, monkeypatch):
    monkeypatch.delenv("HKV_UNSET", raising=False)
    monkeypatch.setenv("HKV_SHORT", "short")
    with pytest.raises(ValueError, match=message):
        auth.load_secret(**kw)


def test_config_checks_the_secret_and_keeps_it_out_of_repr():
    with pytest.raises(ValueError, match="TransportConfig.secret has 3 bytes; expected at least 16"):
        TransportConfig(secret=b"abc")
    with pytest.raises(ValueError, match="TransportConfig.secret is str; expected bytes"):
        TransportConfig(secret=SECRET.decode())  # type: ignore[arg-type]
    assert SECRET.decode() not in repr(TransportConfig(secret=SECRET))
    for key in ("max_handshakes", "max_wants_per_peer", "max_wants"):
        with pytest.raises(ValueError, match=f"TransportConfig.{key} = 0; expected an int >= 1"):
            TransportConfig(**{key: 0})


def test_proofs_bind_both_nonces_the_role_and_the_secret():
    a, b = auth.new_nonce(), auth.new_nonce()
    p = auth.producer_proof(SECRET, a, b)
    assert len(p) == wire.PROOF_BYTES and len(a) == wire.NONCE_BYTES
    assert auth.proven(p, auth.producer_proof(SECRET, a, b))
    # A producer's proof is no consumer's (no reflection), and any other input changes it.
    assert p != auth.consumer_proof(SECRET, a, b)
    assert p != auth.producer_proof(SECRET, b, a)
    assert p != auth.producer_proof(SECRET + b"x", a, b)
    assert not auth.proven(p, b"")


def test_each_role_sends_its_own_proof_and_none_without_a_secret():
    a, b = auth.new_nonce(), auth.new_nonce()
    producer, consumer = wire.Role.PRODUCER, wire.Role.CONSUMER
    assert auth.proof(SECRET, producer, a, b) == auth.producer_proof(SECRET, a, b)
    assert auth.proof(SECRET, consumer, a, b) == auth.consumer_proof(SECRET, a, b)
    assert auth.proves(SECRET, producer, a, b, auth.producer_proof(SECRET, a, b))
    assert not auth.proves(SECRET, consumer, a, b, auth.producer_proof(SECRET, a, b))
    assert not auth.proves(SECRET, producer, a, b, b"")
    # A lab: both sides send empty proofs and neither checks.
    assert auth.proof(None, producer, a, b) == auth.proof(None, consumer, a, b) == b""
    assert auth.proves(None, consumer, a, b, b"")


def test_tokens_are_random_and_travel_as_hex():
    tokens = {auth.new_token() for _ in range(1000)}
    assert len(tokens) == 1000 and {len(t) for t in tokens} == {wire.TOKEN_BYTES}
    t = tokens.pop()
    assert auth.token_from_hex(t.hex()) == t
    for bad in (None, 5, "zz" * 16, t.hex()[:-2], t.hex() + "00"):
        with pytest.raises(ValueError, match="expected 32 hex digits"):
            auth.token_from_hex(bad)
    with pytest.raises(ValueError, match="expected 16 bytes"):
        auth.check_token(t[:8])


_HOSTILE_PRODUCER = """
import asyncio
import numpy as np
from hybridkv import wire
from hybridkv.errors import ProtocolViolation
from hybridkv.transport import control
from hybridkv.transport.config import TransportConfig
from hybridkv.transport.dial import Dialer


class Side:  # all a dial reads before the producer proved the secret
    config = TransportConfig(secret=b"s" * 32)


async def main():
    sent = []

    async def hostile(ch):  # reads the consumer's Auth, answers with a frame of MAX_MESSAGE_BYTES
        await ch.recv(limit=wire.MAX_PREAUTH_BYTES)
        await ch._ep.send(np.array([wire.MAX_MESSAGE_BYTES], dtype="<u8"))
        sent.append(asyncio.ensure_future(ch._ep.send(np.zeros(wire.MAX_MESSAGE_BYTES, dtype=np.uint8))))

    listener = control.listen(hostile, port=0)
    d = Dialer(Side(), on_peer=lambda peer: None)
    try:
        await asyncio.wait_for(d._exchange_hellos("127.0.0.1", listener.port), 20)
        print("RESULT accepted")
    except ProtocolViolation as exc:
        print("RESULT", type(exc).__name__, exc)
    for s in sent:
        s.cancel()
    listener.close()

asyncio.run(main())
"""


def test_a_producer_frame_over_the_preauth_limit_is_refused_before_allocation():
    """A hostile producer answers the consumer's Auth with a frame of MAX_MESSAGE_BYTES before proving
    anything: the consumer refuses it on the frame's header (ProtocolViolation naming the size), it does
    not allocate and wait for the body."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", _HOSTILE_PRODUCER], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert result, done.stderr[-2000:]
    assert result[0].startswith("RESULT ProtocolViolation"), result
    assert f"expected 1..{wire.MAX_PREAUTH_BYTES}" in result[0] and "before proving" in result[0], result


def _endpoint(config):
    """A consumer endpoint on a small real layout (its NIXL agent is made only if the config passes)."""
    from hybridkv.descriptors.planning import DescriptorPlanner
    from hybridkv.fencing.scheduler import TransferScheduler
    from hybridkv.transport.endpoint import Consumer, Pairing
    from tests.transport import peers

    _, memory, pools = peers.build(5)
    return Consumer(memory, TransferScheduler(pools, lease_s=30.0), config,
                    planner=DescriptorPlanner(pairing=Pairing.PAGES))


def test_without_a_secret_an_endpoint_starts_only_in_lab_mode_by_name(monkeypatch, caplog):
    """Secure by default: no secret and no insecure_no_auth is refused before any NIXL agent exists, with a
    message naming the opt-in; lab mode by name starts, logs INSECURE and says so in its metrics."""
    import logging

    from hybridkv.transport import config as config_mod

    monkeypatch.setattr(config_mod, "REQUIRE_SECRET", True)
    with pytest.raises(ValueError, match=r"no TransportConfig.secret; expected a shared secret .* or "
                                         r"insecure_no_auth=True"):
        _endpoint(TransportConfig())
    with pytest.raises(ValueError, match="insecure_no_auth = True with a secret; expected one of the two"):
        TransportConfig(secret=SECRET, insecure_no_auth=True)
    with pytest.raises(ValueError, match="insecure_no_auth = 'yes'; expected a bool"):
        TransportConfig(insecure_no_auth="yes")  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="hybridkv.transport.side"):
        lab = _endpoint(TransportConfig(insecure_no_auth=True))
    assert any("INSECURE" in r.message and "insecure_no_auth" in r.message for r in caplog.records)
    assert lab.metrics.take().insecure_no_auth == 1 and lab.metrics.take().to_dict()["insecure_no_auth"] == 1
    lab.dp.close()
    proven = _endpoint(TransportConfig(secret=SECRET))
    assert proven.metrics.take().insecure_no_auth == 0
    proven.dp.close()
