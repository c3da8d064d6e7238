"""vLLM's P/D request convention (``kv_transfer_params``), as NixlConnector speaks it.

Proxies and routers in front of vLLM P/D (vLLM's toy proxy, Dynamo, llm-d)
send the prefill instance ``{"do_remote_decode": true}`` and forward what it
returns to the decode instance, which then sees ``do_remote_prefill`` plus the
producer's engine id, side-channel host/port, request id and block ids. We read
and write exactly those keys so those routers work unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any

from hybridkv.connectors.vllm.addressing import RankAddress

#: Keys that must all be present for a decode-side load. ``remote_capability`` is hybridkv's own:
#: the request's capability token (hex), without which the producer serves no read of it.
REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids",
               "remote_capability")
#: Prefill side, optional, hybridkv's own: the decode instance a router will hand the request to (its addresses
#: or networks), for a router that picks the decode before it sends the prefill. The request's capability is
#: then good only on a session from there (``hybridkv.transport.auth.Claimants``; docs/security.md).
DECODE_HOSTS = "decode_hosts"


@dataclass(frozen=True, kw_only=True)
class RemotePrefill:
    """Where a decode instance reads a request's cache from."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[tuple[int, ...], ...]
    token: bytes = dataclasses.field(repr=False)
    tp_size: int = 1
    #: Prompt tokens the producer computed (``remote_num_tokens``): decode loads exactly this range or
    #: nothing. None in params that do not say (not hybridkv's producer): the range is not checked.
    num_tokens: int | None = None
    #: Every producer TP rank's address and incarnation (``remote_ranks``); empty in params of
    #: older producers, whose rank r is taken to listen on ``host:port + r``.
    ranks: tuple[RankAddress, ...] = ()

    def rank_address(self, rank: int) -> RankAddress:
        """Where producer TP rank ``rank`` listens, and which incarnation the request names there."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"producer rank {rank}; expected 0..{self.tp_size - 1}")
        if self.ranks:
            return self.ranks[rank]
        return RankAddress(host=self.host, port=self.port + rank)

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RemotePrefill:
        missing = [k for k in REMOTE_KEYS if params.get(k) is None]
        if missing:
            raise ValueError(f"kv_transfer_params lacks {missing}; expected all of {list(REMOTE_KEYS)}")
        blocks = params["remote_block_ids"]
        if not isinstance(blocks, Sequence) or isinstance(blocks, (str, bytes)):
            raise ValueError(f"remote_block_ids = {blocks!r}; expected one list of block ids per group")
        # A single flat list is the single-group (non-HMA) form.
        if blocks and all(isinstance(b, int) for b in blocks):
            blocks = [blocks]
        groups: list[tuple[int, ...]] = []
        for g, ids in enumerate(blocks):
            if not isinstance(ids, Sequence) or not all(isinstance(b, int) and b >= 0 for b in ids):
                raise ValueError(f"remote_block_ids[{g}] = {ids!r}; expected non-negative ints")
            groups.append(tuple(ids))
        port = params["remote_port"]
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"remote_port = {port!r}; expected a TCP port")
        from hybridkv.transport.auth import token_from_hex

        token = token_from_hex(params["remote_capability"], "remote_capability")
        tp = params.get("tp_size", 1)
        if not isinstance(tp, int) or tp <= 0:
            raise ValueError(f"tp_size = {tp!r}; expected a positive int")
        raw_ranks = params.get("remote_ranks") or ()
        if not isinstance(raw_ranks, Sequence) or isinstance(raw_ranks, (str, bytes)):
            raise ValueError(f"remote_ranks = {raw_ranks!r}; expected one [host, port, agent] per producer TP rank")
        ranks = tuple(RankAddress.from_json(a, what=f"remote_ranks[{i}]") for i, a in enumerate(raw_ranks))
        num_tokens = params.get("remote_num_tokens")
        if num_tokens is not None and (not isinstance(num_tokens, int) or isinstance(num_tokens, bool)
                                       or num_tokens < 0):
            raise ValueError(f"remote_num_tokens = {num_tokens!r}; expected a non-negative int")
        if ranks and len(ranks) != tp:
            raise ValueError(f"remote_ranks lists {len(ranks)} rank(s); expected tp_size = {tp}")
        return cls(
            engine_id=str(params["remote_engine_id"]),
            request_id=str(params["remote_request_id"]),
            host=str(params["remote_host"]),
            port=port,
            block_ids=tuple(groups),
            token=token,
            tp_size=tp,
            num_tokens=num_tokens,
            ranks=ranks,
        )


def claimants(params: Mapping[str, Any] | None):
    """Prefill side: whom the request's capability is bound to (``DECODE_HOSTS``), or None (unbound: whichever
    session presents the token first). Raises ValueError naming the value where it is not addresses/networks."""
    hosts = params.get(DECODE_HOSTS) if params else None
    if hosts is None:
        return None
    if isinstance(hosts, str):
        hosts = [hosts]
    if not isinstance(hosts, Sequence) or not hosts or not all(isinstance(h, str) for h in hosts):
        raise ValueError(f"{DECODE_HOSTS} = {hosts!r}; expected the decode instance's IP addresses or networks "
                         "(e.g. ['10.0.0.7'] or '10.0.1.0/24')")
    from hybridkv.transport.allowlist import PeerAllowlist
    from hybridkv.transport.auth import Claimants

    return Claimants(networks=PeerAllowlist.parse(hosts))


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """Decode side: this request's prompt cache is to be read from a producer."""
    return bool(params) and bool(params.get("do_remote_prefill"))


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Prefill side: this request's cache is to be handed to a decode instance."""
    return bool(params) and bool(params.get("do_remote_decode"))


def producer_params(
    *,
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    block_ids: Sequence[Sequence[int]],
    tp_size: int,
    num_tokens: int,
    lease_s: float,
    ranks: Sequence[RankAddress] = (),
    token: bytes,
) -> dict[str, Any]:
    """What the prefill instance returns for the decode instance (NixlConnector's keys, plus
    ``remote_ranks``: every TP rank's [host, port, agent])."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "remote_block_ids": [list(g) for g in block_ids],
        "tp_size": tp_size,
        "remote_num_tokens": num_tokens,
        "remote_lease_s": lease_s,
        "remote_capability": token.hex(),
        "transfer_mode": "pull",
        "transfer_backend": "hybridkv",
        "remote_ranks": [a.to_json() for a in ranks],
    }
