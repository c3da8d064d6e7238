"""Where each rank of a prefill engine listens, and how a decode rank names it.

Every worker (TP rank) of a prefill engine runs its own control listener. Its
port is ``side_channel_port + data_parallel_index * tp_size + tp_rank``: unique
over every rank of every DP engine of one deployment, so DP engines sharing a
host cannot collide. Its host is the configured ``side_channel_host``, or, with
``"auto"``, the address vLLM finds for the worker's own node (``VLLM_HOST_IP``
or the default route), so a TP group spread over nodes names each rank's node.

The scheduler half learns every rank's address and *incarnation* (the NIXL agent
name its worker chose at start-up, random per process) through vLLM's handshake
metadata path (``get_handshake_metadata`` on each worker, collected by the engine
core into ``set_xfer_handshake_metadata``) and lists them in ``kv_transfer_params``
(``remote_ranks``). A decode rank dials exactly the rank named there and checks
that the agent answering is the incarnation the request names: a restarted
producer answers with a new one, and requests of the old one fail at once.

This module does not import vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: ``side_channel_host`` value: each worker advertises its own node's address.
AUTO_HOST = "auto"


@dataclass(frozen=True, kw_only=True)
class RankAddress:
    """One producer rank: where its control listener is, and which incarnation listens there."""

    host: str
    port: int
    #: The NIXL agent name of the producer process: new at every start, so it tells
    #: a restarted producer at the same address apart. None: not known (older params).
    agent: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"rank host = {self.host!r}; expected a non-empty host name or address")
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 < self.port < 65536:
            raise ValueError(f"rank port = {self.port!r}; expected a TCP port, 1..65535")
        if self.agent is not None and (not isinstance(self.agent, str) or not self.agent):
            raise ValueError(f"rank agent = {self.agent!r}; expected a non-empty agent name or null")

    def to_json(self) -> list[Any]:
        return [self.host, self.port, self.agent]

    @classmethod
    def from_json(cls, value: Any, *, what: str) -> RankAddress:
        if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or len(value) != 3:
            raise ValueError(f"{what} = {value!r}; expected [host, port, agent]")
        host, port, agent = value
        try:
            return cls(host=host, port=port, agent=agent)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None


def listen_port(base: int, *, dp_index: int, tp_size: int, tp_rank: int) -> int:
    """The control port of one worker; refuses a deployment whose ports run past 65535."""
    port = base + dp_index * tp_size + tp_rank
    if not 0 < port < 65536:
        raise ValueError(f"side_channel_port {base} + data_parallel_index {dp_index} x tensor_parallel_size "
                         f"{tp_size} + tp_rank {tp_rank} = {port}; expected a TCP port, 1..65535 "
                         "(lower side_channel_port)")
    return port


def resolve_host(configured: str) -> str:
    """The address a worker advertises: the configured one, or its node's for ``"auto"``."""
    if configured != AUTO_HOST:
        return configured
    from vllm.utils.network_utils import get_ip  # only "auto" needs vLLM

    return get_ip()


def ranks_from_handshake(by_rank: Mapping[int, Any], *, tp_size: int) -> tuple[RankAddress, ...]:
    """Every TP rank's address, from what the engine core collected of its workers;
    refuses a set that misses a rank or holds something else."""
    missing = sorted(set(range(tp_size)) - set(by_rank))
    extra = sorted(set(by_rank) - set(range(tp_size)))
    if missing or extra:
        raise ValueError(f"handshake metadata for TP ranks {sorted(by_rank)}; expected exactly 0..{tp_size - 1} "
                         f"(missing {missing}, unexpected {extra})")
    out = []
    for r in range(tp_size):
        m = by_rank[r]
        address = getattr(m, "address", None)
        if not isinstance(address, RankAddress):
            raise ValueError(f"handshake metadata of TP rank {r} is {type(m).__name__}; expected "
                             "HybridKVHandshakeMetadata (is every worker running HybridKVConnector?)")
        out.append(address)
    return tuple(out)


__all__ = ["AUTO_HOST", "RankAddress", "listen_port", "ranks_from_handshake", "resolve_host"]
