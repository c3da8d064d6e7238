"""The shared secret, the handshake's proofs and request capabilities (hybridkv.transport.auth)."""

from __future__ import annotations

import pytest

from hybridkv import wire
from hybridkv.transport import auth
from hybridkv.transport.config import TransportConfig

SECRET = b"2b64d066c6b894281b6f884cb058811e2662b3fac1cf457ec46bc168e41e8cc8"  # hex of 32 random bytes


@pytest.fixture
def strict(monkeypatch):
    """The strength rules and the file-mode check refuse (as they will once the lead turns them on)."""
    monkeypatch.setattr(auth, "STRICT_SECRETS", True)


def _private(path, data: bytes):
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def test_the_secret_comes_from_a_file_or_an_environment_variable(tmp_path, monkeypatch, strict):
    path = _private(tmp_path / "secret", SECRET + b"\n")  # as `echo` or `base64` write it
    assert auth.load_secret(file=path) == SECRET
    monkeypatch.setenv("HKV_SECRET", SECRET.decode())
    assert auth.load_secret(env="HKV_SECRET") == SECRET


def test_a_connector_setting_names_the_secret_source_and_prefixes_its_errors(tmp_path, monkeypatch, strict):
    """One loader for every connector's secret_file / secret_env: None without a source, errors named as the
    connector spells the setting."""
    key = "HKV_{}".format
    assert auth.load_configured_secret(file=None, env=None, key=key) is None
    path = _private(tmp_path / "secret", SECRET + b"\n")
    assert auth.load_configured_secret(file=str(path), env=None, key=key) == SECRET
    monkeypatch.delenv("HKV_UNSET", raising=False)
    with pytest.raises(ValueError, match=r"^HKV_secret_env: environment variable 'HKV_UNSET' is not set"):
        auth.load_configured_secret(file=None, env="HKV_UNSET", key=key)
    with pytest.raises(ValueError, match=r"^HKV_secret_file: secret file '/nonexistent/hkv' cannot be read"):
        auth.load_configured_secret(file="/nonexistent/hkv", env=None, key=key)


@pytest.mark.parametrize(("kw", "message"), [
    ({}, "expected exactly one of the two"),
    ({"file": "/a", "env": "B"}, "expected exactly one of the two"),
    ({"file": "/nonexistent/hkv"}, r"secret file '/nonexistent/hkv' cannot be read"),
    ({"env": "HKV_UNSET"}, r"environment variable 'HKV_UNSET' is not set"),
    ({"env": "HKV_SHORT"}, r"environment variable 'HKV_SHORT' has 5 bytes; expected at least (16|32) .*; "
                           r"make one with `hybridkv secret FILE`"),
])
def test_an_unusable_secret_is_named(kw, message, monkeypatch):
    monkeypatch.delenv("HKV_UNSET", raising=False)
    monkeypatch.setenv("HKV_SHORT", "short")
    with pytest.raises(ValueError, match=message):
        auth.load_secret(**kw)


def test_config_checks_the_secret_and_keeps_it_out_of_repr():
    with pytest.raises(ValueError, match="TransportConfig.secret has 3 bytes; expected at least (16|32)"):
        TransportConfig(secret=b"abc")  # below 16 bytes: refused even with STRICT_SECRETS off
    with pytest.raises(ValueError, match="TransportConfig.secret is str; expected bytes"):
        TransportConfig(secret=SECRET.decode())  # type: ignore[arg-type]
    assert SECRET.decode() not in repr(TransportConfig(secret=SECRET))
    for key in ("max_handshakes", "max_wants_per_peer", "max_wants"):
        with pytest.raises(ValueError, match=f"TransportConfig.{key} = 0; expected an int >= 1"):
            TransportConfig(**{key: 0})


# The test suites' weak secrets of the other harnesses, and what each breaks.
WEAK = [
    (b"0123456789abcdef-file", "has 21 bytes; expected at least 32 random bytes"),
    (b"correct horse battery staple 42!", "is text of 32 characters that is neither hex nor base64"),
    (b"rank-peers-shared-secret-0123456789", "is text of 35 characters that is neither hex nor base64"),
    (b"correcthorsebatterystaplecorrecthorsebattery", "neither hex nor base64"),  # base64's alphabet, one case
    (b"s" * 32, "neither hex nor base64"),
    (b"0123456789abcdef" * 2, "is hex of 16 bytes; expected at least 32 decoded bytes"),
    (b"0123456789abcdef" * 4, r"has 8 distinct byte values \(decoded from hex\); expected at least 16"),
    (bytes(range(8)) * 4 + b"\xff", r"has 9 distinct byte values \(binary\); expected at least 16"),
    (b"AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGw==", "is base64 of 28 bytes; expected at least 32 decoded bytes"),
]


@pytest.mark.parametrize(("secret", "rule"), WEAK + [(b"abc", "has 3 bytes; expected at least 32 random bytes")])
def test_a_weak_secret_is_refused_naming_the_rule_and_the_fix(secret, rule, strict):
    with pytest.raises(ValueError, match=f"TransportConfig.secret .*{rule}.*make one with `hybridkv secret FILE`"):
        TransportConfig(secret=secret)


def test_strong_secrets_pass_in_each_form(strict):
    import base64
    import secrets

    for _ in range(200):  # random bytes never trip a rule: as raw bytes, hex, base64 and url-safe base64
        raw = secrets.token_bytes(32)
        for form in (raw, raw.hex().encode(), raw.hex().upper().encode(), base64.b64encode(raw),
                     base64.urlsafe_b64encode(raw).rstrip(b"=")):
            assert auth.secret_weakness(form) is None, form
            TransportConfig(secret=form)


@pytest.mark.parametrize("strict_secrets", [False, True], ids=["lenient", "strict"])
def test_a_weak_secret_is_a_warning_until_strict_secrets_is_on(strict_secrets, monkeypatch, caplog):
    """Either way the rule is named: a warning with STRICT_SECRETS off (today), refused with it on."""
    import logging

    monkeypatch.setattr(auth, "STRICT_SECRETS", strict_secrets)
    monkeypatch.setattr(auth, "_warned", set())  # warned once per process: an earlier test may have
    weak = b"hybridkv-tests-shared-secret-0123-warned"
    with caplog.at_level(logging.WARNING, logger="hybridkv.transport.auth"):
        if strict_secrets:
            with pytest.raises(ValueError, match="TransportConfig.secret is text of 40 characters that is neither "
                                                 "hex nor base64.*make one with `hybridkv secret FILE`"):
                TransportConfig(secret=weak)
        else:
            TransportConfig(secret=weak)
    warned = [r for r in caplog.records if "neither hex nor base64" in r.message and "STRICT_SECRETS" in r.message]
    assert len(warned) == (0 if strict_secrets else 1)


def test_a_secret_file_group_or_others_can_read_is_refused(tmp_path, strict):
    path = _private(tmp_path / "secret", SECRET)
    assert auth.load_secret(file=path) == SECRET
    path.chmod(0o400)
    assert auth.load_secret(file=path) == SECRET
    for mode in (0o640, 0o644, 0o604, 0o660):
        path.chmod(mode)
        with pytest.raises(ValueError, match=rf"secret file '{path}' has mode {mode:04o}: group or others can "
                                             rf"access it; expected mode 0600 or 0400 \(chmod 600 '{path}'\)"):
            auth.load_secret(file=path)
    weak = _private(tmp_path / "weak", b"correct horse battery staple 42!\n")
    with pytest.raises(ValueError, match=rf"secret file '{weak}' is text of 32 characters that is neither"):
        auth.load_secret(file=weak)


def _transcript(**over) -> auth.Transcript:
    base = dict(consumer_nonce=b"c" * 32, producer_nonce=b"p" * 32, dialled="10.0.0.2:5000",
                producer="10.0.0.2:5000", consumer_agent="decode-agent", producer_agent="prefill-agent")
    return auth.Transcript(**{**base, **over})


def test_proofs_bind_the_connection_the_role_and_the_secret():
    """Each proof covers both nonces, the address dialled, the producer's own address and both agent
    names: a relay's transcript (dialled at its own address) is never the producer's."""
    t = _transcript()
    p = auth.proof(SECRET, wire.Role.PRODUCER, t)
    assert len(p) == wire.PROOF_BYTES
    assert auth.proves(SECRET, wire.Role.PRODUCER, t, p)
    # A producer's proof is no consumer's (no reflection), and any other input changes it.
    assert not auth.proves(SECRET, wire.Role.CONSUMER, t, p)
    assert not auth.proves(SECRET + b"x", wire.Role.PRODUCER, t, p)
    for field, value in [("consumer_nonce", b"d" * 32), ("producer_nonce", b"q" * 32), ("dialled", "10.0.0.9:5000"),
                         ("producer", "10.0.0.2:5001"), ("consumer_agent", "other"), ("producer_agent", "other")]:
        assert not auth.proves(SECRET, wire.Role.PRODUCER, _transcript(**{field: value}), p), field
    # Length-prefixed parts: moving a byte from one field to the next is another transcript.
    assert auth.proof(SECRET, wire.Role.PRODUCER, _transcript(dialled="a", producer="bc")) != \
        auth.proof(SECRET, wire.Role.PRODUCER, _transcript(dialled="ab", producer="c"))
    assert not auth.proven(p, b"")
    assert auth.session_key(SECRET, t) not in (p, auth.proof(SECRET, wire.Role.CONSUMER, t))


def test_each_role_sends_its_own_proof_and_none_without_a_secret():
    t = _transcript()
    producer, consumer = wire.Role.PRODUCER, wire.Role.CONSUMER
    assert auth.proof(SECRET, producer, t) != auth.proof(SECRET, consumer, t)
    assert not auth.proves(SECRET, producer, t, b"")
    # A lab: both sides send empty proofs and neither checks.
    assert auth.proof(None, producer, t) == auth.proof(None, consumer, t) == b""
    assert auth.proves(None, consumer, t, b"")
    assert auth.address("10.0.0.2", 5000) == "10.0.0.2:5000" and auth.address("::1", 5000) == "[::1]:5000"


def test_sealed_frames_open_only_in_order_in_their_direction_under_their_key():
    key = auth.session_key(SECRET, _transcript())
    prod, cons = auth.Sealer(key, wire.Role.PRODUCER), auth.Sealer(key, wire.Role.CONSUMER)
    frames = [prod.seal(b"hello"), prod.seal(b"export")]
    assert cons.open(frames[0]) == b"hello" and cons.open(frames[1]) == b"export"
    replayed = auth.Sealer(key, wire.Role.CONSUMER)
    replayed.open(frames[0])
    with pytest.raises(ValueError, match="frame 1 from the peer does not carry the session's MAC"):
        replayed.open(frames[0])  # replayed
    with pytest.raises(ValueError, match="frame 0 .* does not carry"):
        auth.Sealer(key, wire.Role.CONSUMER).open(frames[1])  # out of order
    with pytest.raises(ValueError, match="does not carry"):
        auth.Sealer(key, wire.Role.PRODUCER).open(frames[0])  # reflected to its sender
    with pytest.raises(ValueError, match="does not carry"):
        auth.Sealer(auth.session_key(SECRET, _transcript(dialled="relay:1")), wire.Role.CONSUMER).open(frames[0])
    altered = bytearray(frames[0])
    altered[0] ^= 1
    with pytest.raises(ValueError, match="does not carry"):
        auth.Sealer(key, wire.Role.CONSUMER).open(bytes(altered))
    with pytest.raises(ValueError, match="expected a body and a 32-byte MAC"):
        auth.Sealer(key, wire.Role.CONSUMER).open(b"x" * 32)


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
    config = TransportConfig(secret=bytes(range(32)))

    class dp:
        name = "decode-agent"


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
    proven = _endpoint(TransportConfig(secret=SECRET, insecure_host_memory=True))
    assert proven.metrics.take().insecure_no_auth == 0
    proven.dp.close()


def test_an_operator_compat_map_that_differs_refuses_the_pair_naming_each_key_and_both_values():
    """TransportConfig.compat travels in the authenticated Hello: a key whose values differ, or that one
    side has and the other lacks, refuses the pair at its first handshake; equal maps connect."""
    from tests.transport.harness import consumer, producer

    with pytest.raises(ValueError, match=r"TransportConfig.compat\['model'\] = 3; expected a str"):
        TransportConfig(compat={"model": 3})  # type: ignore[dict-item]
    ops = {"model": "qwen3-next", "revision": "r1"}
    prod = producer(compat=ops)
    try:
        host, port, _ = prod.expect("addr")
        cons = consumer((host, port), attempts=[
            {"name": "differs", "compat": {"model": "qwen3-next", "revision": "r2", "quant": "fp8"}},
            {"name": "same", "compat": dict(ops)}])
        name, fields, text = cons.expect("refused")
        assert name == "differs" and fields == ["quant", "revision"], (fields, text)
        assert "revision: local 'r2', peer 'r1'" in text and "quant: local 'fp8', peer None" in text, text
        assert cons.expect("connected") == "same"
        cons.expect("finished")
    finally:
        prod.stop()
