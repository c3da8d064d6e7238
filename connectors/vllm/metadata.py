"""What the scheduler half tells the worker half each step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from hybridkv.connectors.vllm.addressing import RankAddress
from hybridkv.connectors.vllm.params import RemotePrefill

BlockIds = tuple[tuple[int, ...], ...]  # one tuple of block ids per transfer group


@dataclass(frozen=True, kw_only=True)
class RecvOrder:
    """Decode side: read ``remote``'s blocks into ``local_block_ids`` now.

    Issued only once hybridkv's fence allows writing every local block
    (no pending step touches it: Race A)."""

    request_id: str
    transfer_id: int
    local_block_ids: BlockIds
    remote: RemotePrefill


@dataclass(kw_only=True)
class HybridKVConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per scheduled step."""

    step: int
    recvs: list[RecvOrder] = field(default_factory=list)
    #: Prefill side: requests whose blocks every write has landed in (export rule):
    #: the worker may now serve reads of them.
    exports_ready: dict[str, BlockIds] = field(default_factory=dict)
    #: Prefill side: the capability token of each request in ``exports_ready`` (the one
    #: returned in its kv_transfer_params): readers must present it.
    capabilities: dict[str, bytes] = field(default_factory=dict)
    #: Prefill side: the decode addresses/networks a request's capability is bound to, where its
    #: kv_transfer_params named them (``decode_hosts``); absent: unbound.
    decode_hosts: dict[str, list[str]] = field(default_factory=dict)
    #: Prefill side: requests whose export ended (read done, lease lapsed, abort).
    exports_ended: list[str] = field(default_factory=list)
    #: Decode side: requests queued since the last step: the worker asks their producer ranks
    #: for them now and renews their leases until it reads them (leases run from arrival).
    heartbeats: dict[str, RemotePrefill] = field(default_factory=dict)
    #: Decode side: queued requests this engine will not read (aborted, nothing left to load):
    #: the worker tells their producer ranks, which free the blocks at once.
    releases: dict[str, RemotePrefill] = field(default_factory=dict)
    #: Decode side: loads the scheduler refused (why), e.g. a producer that computed another token range
    #: than this engine schedules: the worker reports them failed, so ``kv_load_failure_policy`` applies
    #: (recompute or fail) and no block of theirs is written or cached.
    refused: dict[str, str] = field(default_factory=dict)


@dataclass(kw_only=True)
class HybridKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per executed step; aggregated over TP ranks."""

    #: The step this worker executed; the device work of it has completed when
    #: the scheduler processes this output.
    step: int
    #: Prefill side: export leases the consumer renewed.
    renewed: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, HybridKVWorkerMetadata):
            raise ValueError(f"cannot aggregate {type(other).__name__}; expected HybridKVWorkerMetadata")
        # A step is complete only once every rank completed it; a lease lives on
        # while any rank's reader still renews it.
        return HybridKVWorkerMetadata(step=min(self.step, other.step), renewed=self.renewed | other.renewed)


@dataclass(frozen=True, kw_only=True)
class HybridKVHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler once at start-up (vLLM's handshake metadata path): where this
    producer rank listens and which incarnation it is."""

    tp_rank: int
    address: RankAddress
