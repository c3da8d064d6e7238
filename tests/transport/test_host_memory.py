"""Host memory in authenticated mode (transport/host_memory.py): over UCX's software transports (tcp, shm, cma)
a peer holding the NIXL metadata reaches the whole producer process (tests/transport/attacks.py's tampered
metadata: the secret read from the heap), so an endpoint with a secret that registers host memory starts only
where UCX_TLS leaves UCX no software transport, or where the operator accepts that by name
(``insecure_host_memory``). Before it, an endpoint with a secret started on host memory without a word."""

from __future__ import annotations

import pytest

from hybridkv.transport.config import TransportConfig
from hybridkv.transport.host_memory import check_host_memory, software_transports
from tests.transport.peers import SECRET
from tests.transport.test_secure_default import _endpoint, agents  # noqa: F401 - the fixture


@pytest.mark.parametrize("tls,soft", [
    (None, ("tcp", "shm", "cma")), ("all", ("tcp", "shm", "cma")), ("tcp", ("tcp",)), ("rc,tcp", ("tcp",)),
    ("sm,rc", ("sm",)), ("cma,posix", ("cma", "posix")), ("rc,cuda_ipc,cuda_copy", ()), ("rc_x,dc_x,ud", ()),
    ("^tcp", ("shm", "cma")), ("^tcp,sm", ()), ("^tcp,shm,cma", ()), (" RC , CUDA_IPC ", ()),
])
def test_software_transports_follow_ucx_tls(tls, soft):
    assert software_transports({} if tls is None else {"UCX_TLS": tls}) == soft


@pytest.mark.parametrize("kind", ["producer", "consumer"])
def test_an_authenticated_endpoint_on_host_memory_is_refused_naming_both_ways_out(kind, agents, monkeypatch):  # noqa: F811
    monkeypatch.delenv("UCX_TLS", raising=False)
    with pytest.raises(ValueError) as err:
        _endpoint(kind, TransportConfig(secret=SECRET))
    msg = str(err.value)
    assert msg.startswith(f"hybridkv {kind}: host-memory KV cache with a shared secret"), msg
    assert "tcp, shm, cma" in msg and "UCX_TLS=rc,cuda_ipc" in msg and "insecure_host_memory=True" in msg, msg
    assert agents == []  # refused before any NIXL agent existed


def test_accepted_by_name_or_lab_mode_starts(agents):  # noqa: F811
    for config in (TransportConfig(secret=SECRET, insecure_host_memory=True), TransportConfig(insecure_no_auth=True)):
        _endpoint("producer", config)
    assert len(agents) == 2


def test_hardware_transports_or_device_memory_need_no_opt_in():
    check_host_memory(authenticated=True, host_memory=True, accepted=False, what="x", opt_in="y",
                      environ={"UCX_TLS": "rc,cuda_ipc"})
    check_host_memory(authenticated=True, host_memory=False, accepted=False, what="x", opt_in="y", environ={})
    with pytest.raises(ValueError, match="over tcp \\(UCX_TLS='rc,tcp'\\)"):
        check_host_memory(authenticated=True, host_memory=True, accepted=False, what="x", opt_in="y",
                          environ={"UCX_TLS": "rc,tcp"})


def test_the_flag_is_a_bool():
    with pytest.raises(ValueError, match="insecure_host_memory = 'yes'; expected a bool"):
        TransportConfig(secret=SECRET, insecure_host_memory="yes")  # type: ignore[arg-type]
