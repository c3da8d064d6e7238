"""Secure by default, with both gates on as they will be (``config.REQUIRE_SECRET``,
``auth.STRICT_SECRETS``): a Producer or Consumer without a secret refuses to start, naming the
opt-in (``insecure_no_auth``) and the fix (``hybridkv secret FILE``); lab mode by name starts and
says so loudly; a secret `hybridkv secret` wrote starts both and they complete a handshake; a weak
secret or a secret file others can read is refused before any endpoint exists."""

from __future__ import annotations

import asyncio
import logging

import pytest

from hybridkv.transport import auth
from hybridkv.transport import config as config_mod
from hybridkv.transport.config import TransportConfig


@pytest.fixture
def gates_on(monkeypatch):
    monkeypatch.setattr(config_mod, "REQUIRE_SECRET", True)
    monkeypatch.setattr(auth, "STRICT_SECRETS", True)


@pytest.fixture
def agents(monkeypatch):
    """Every NIXL agent (data plane) an endpoint made: a refused one must have made none."""
    from hybridkv.transport import side

    made = []

    class Spy(side.DataPlane):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self)

    monkeypatch.setattr(side, "DataPlane", Spy)
    yield made
    for dp in made:
        dp.close()


def _endpoint(kind: str, config: TransportConfig, seed: int = 5):
    from hybridkv.descriptors.planning import DescriptorPlanner
    from hybridkv.fencing.scheduler import TransferScheduler
    from hybridkv.transport.endpoint import Consumer, Pairing, Producer
    from tests.transport import peers

    _, memory, pools = peers.build(seed)
    cls = Producer if kind == "producer" else Consumer
    return cls(memory, TransferScheduler(pools, lease_s=30.0), config, planner=DescriptorPlanner(pairing=Pairing.PAGES))


@pytest.mark.parametrize("kind", ["producer", "consumer"])
def test_without_a_secret_an_endpoint_refuses_to_start_naming_the_opt_in(kind, gates_on, agents):
    with pytest.raises(ValueError) as err:
        _endpoint(kind, TransportConfig())
    msg = str(err.value)
    assert msg.startswith(f"hybridkv {kind}: no TransportConfig.secret"), msg
    assert "insecure_no_auth=True" in msg and "`hybridkv secret FILE`" in msg, msg
    assert agents == []  # refused before any NIXL agent (and its metadata) exists


def test_lab_mode_by_name_starts_and_says_so_loudly(gates_on, agents, caplog):
    async def run():
        prod = _endpoint("producer", TransportConfig(insecure_no_auth=True))
        _, port = await prod.start()
        cons = _endpoint("consumer", TransportConfig(insecure_no_auth=True), seed=6)
        agent = await cons.connect("127.0.0.1", port)  # a lab pair still works
        assert agent == prod.dp.name
        metrics = (prod.metrics.take().insecure_no_auth, cons.metrics.take().insecure_no_auth)
        await cons.close()
        await prod.close()
        return metrics

    with caplog.at_level(logging.WARNING, logger="hybridkv.transport.side"):
        assert asyncio.run(run()) == (1, 1)
    insecure = [r.getMessage() for r in caplog.records if r.getMessage().startswith("INSECURE")]
    assert any("producer listening" in m and "(insecure_no_auth)" in m for m in insecure), insecure
    assert any(m.startswith("INSECURE: hybridkv consumer") and "(insecure_no_auth)" in m for m in insecure), insecure


def test_a_secret_hybridkv_secret_wrote_starts_both_sides(gates_on, agents, tmp_path, caplog):
    from hybridkv.transport.secret_cli import write_secret

    path = tmp_path / "hkv.secret"
    write_secret(path)  # what `hybridkv secret FILE` does
    secret = auth.load_secret(file=path)  # strict: strength and mode 0600 checked

    async def run():
        prod = _endpoint("producer", TransportConfig(secret=secret, insecure_host_memory=True))
        _, port = await prod.start()
        cons = _endpoint("consumer", TransportConfig(secret=secret, insecure_host_memory=True), seed=6)
        agent = await cons.connect("127.0.0.1", port)  # both proved the secret
        assert agent == prod.dp.name and list(prod.peers) == [cons.dp.name]
        metrics = (prod.metrics.take().insecure_no_auth, cons.metrics.take().insecure_no_auth)
        await cons.close()
        await prod.close()
        return metrics

    with caplog.at_level(logging.WARNING):
        assert asyncio.run(run()) == (0, 0)
    assert not [r for r in caplog.records if "INSECURE" in r.getMessage() or "weak shared secret" in r.getMessage()]


@pytest.mark.parametrize(("data", "mode", "rule"), [
    (b"correct horse battery staple 42!\n", 0o600, "is text of 32 characters that is neither hex nor base64"),
    (b"0123456789abcdef-file\n", 0o600, "has 21 bytes; expected at least 32 random bytes"),
    (None, 0o644, r"has mode 0644: group or others can access it; expected mode 0600 or 0400"),
], ids=["passphrase", "short", "readable-by-others"])
def test_a_weak_secret_is_refused_before_any_endpoint(data, mode, rule, gates_on, tmp_path):
    from hybridkv.transport.secret_cli import write_secret

    path = tmp_path / "hkv.secret"
    if data is None:
        write_secret(path)  # a strong secret, in a file others can read
    else:
        path.write_bytes(data)
    path.chmod(mode)
    with pytest.raises(ValueError, match=rf"secret file '{path}' {rule}.*`hybridkv secret FILE`"):
        auth.load_secret(file=path)
    if data is not None:
        with pytest.raises(ValueError, match=rf"TransportConfig.secret {rule}"):
            TransportConfig(secret=data.rstrip(b"\n"))
