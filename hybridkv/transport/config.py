"""What an endpoint is told, and what it reports.

:class:`TransportConfig` (with :class:`FailurePolicy`) sets up a
:class:`~hybridkv.transport.endpoint.Producer` or
:class:`~hybridkv.transport.endpoint.Consumer`, :class:`Pairing` is what a planner's
handshake promises; :class:`Result` (with
:class:`Outcome`) is how one request's transfer ended and :class:`Stats` counts
what an endpoint refused or ignored. The design is in
:mod:`hybridkv.transport.endpoint`, which re-exports these.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridkv import wire
from hybridkv.transport import auth
from hybridkv.transport.allowlist import PeerAllowlist
from hybridkv.transport.dataplane import DataPlaneConfig
from hybridkv.transport.settings import check_auth_flags

#: Whether an endpoint without a secret refuses to start unless ``insecure_no_auth`` says lab mode
#: by name (secure by default; see :func:`check_auth_mode`). Every connector passes
#: ``insecure_no_auth`` through from its own configuration.
REQUIRE_SECRET = True


class FailurePolicy(enum.Enum):
    """What a failed import turns into (vLLM's ``kv_load_failure_policy``)."""

    FAIL = "fail"  # the request is aborted
    RECOMPUTE = "recompute"  # the request computes its prompt locally


class Pairing(enum.Enum):
    """How blocks pair. A planner (:mod:`hybridkv.transport.plan`) says which its side's
    handshake promises; the planner alone decides how each import pairs."""

    PAGES = "pages"  # page for page: both sides cut pages alike (same TP, block size, page format)
    FIELDS = "fields"  # field by field where pages differ (heterogeneous TP, block sizes): field tables travel


class Outcome(enum.Enum):
    READY = "ready"  # consumer: every component arrived
    RECOMPUTE = "recompute"  # consumer: import failed, request recomputes locally
    DONE = "done"  # producer: consumer finished with the blocks
    FAILED = "failed"  # request failed (aborted)
    EXPIRED = "expired"  # producer: the lease lapsed first


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    host: str = "127.0.0.1"  # interface the producer advertises / the consumer dials
    port: int = 0
    mode: wire.Mode = wire.Mode.PULL
    handshake_timeout_s: float = 5.0
    # Consumer: a handshake that times out (or cannot reach the producer) is tried again this many
    # times, after handshake_backoff_s, doubled each time: a producer stalled for a few seconds (a
    # long GC pause, a busy host) is waited out, one that stays away fails its dial, not the worker.
    handshake_retries: int = 2
    handshake_backoff_s: float = 0.5
    export_timeout_s: float = 30.0  # consumer: how long to wait for the producer's Export
    heartbeat_s: float | None = None  # default: lease / 6 (vLLM's choice)
    lease_margin: float = 0.1  # fraction of a granted lease the consumer does not rely on
    failure_policy: FailurePolicy = FailurePolicy.FAIL
    pump_busy_s: float = 0.0002
    pump_idle_s: float = 0.005
    # A posted READ still in progress after this long (or past its lease) is aborted: a stuck
    # peer or link must end as a failure the policy handles, never as an import that waits forever.
    # Push: also the drain deadline, how long a failed import's blocks wait for the producer's word
    # that its WRITE ended before they go back anyway (transport/drains.py).
    transfer_timeout_s: float = 60.0
    # PULL: whether the consumer's READ also carries a NIXL notification to the producer. Off: the
    # Done message says the same over the control channel, and on the H200s a READ with a
    # notification ended ~75 us later (320 MB over NVLink: 330 vs 356 GB/s, `bench transfer`).
    notify_reads: bool = False
    # Producer: peers (addresses or CIDR networks) that may connect; empty means any. The listener
    # itself is open on every interface (ucxx 0.52), so this is what keeps other networks out.
    allowed_peers: tuple[str, ...] = ()
    # The shared secret both peers prove in the handshake (hybridkv.transport.auth; read it with
    # auth.load_secret from a file or an environment variable). None: any peer that reaches the
    # port is served, and the endpoint logs a warning when it starts. Kept out of repr().
    secret: bytes | None = field(default=None, repr=False)
    # Lab mode, by name: no secret, and any peer that reaches the port gets the NIXL metadata (and
    # with it one-sided access to this process's registered memory). Without a secret and without
    # this, an endpoint refuses to start (REQUIRE_SECRET); with it, it logs so loudly at start and
    # its metrics say so (MetricsSnapshot.insecure_no_auth).
    insecure_no_auth: bool = False
    # With a secret, host-memory registrations start only where UCX_TLS leaves UCX no software transport
    # (tcp, shm, cma...: they do not bound a peer's READs and WRITEs to the registration, so a secret
    # holder could reach this whole process); True accepts that by name (transport/host_memory.py).
    insecure_host_memory: bool = False
    # Operator-supplied compatibility fields (e.g. {"model": "...", "revision": "..."}), exchanged in
    # the authenticated handshake next to the transport's own: a pair whose maps differ (a key on one
    # side only counts) is refused at its first handshake, naming each differing key and both values.
    compat: Mapping[str, str] = field(default_factory=dict)
    # Producer bounds, per peer and in total: connections still in their handshake (each costs a
    # task and a UCX endpoint until handshake_timeout_s), and Wants that came before their export
    # (a peer past its share is disconnected; it alone loses, never a consumer within its share).
    max_handshakes: int = 64
    # ... and from one address. Past either bound, a new connection waits its turn, unread, and takes the
    # slot of a handshake silent on its turn for 0.5 s (a half-open one): see transport/admission.py.
    max_handshakes_per_address: int = 16
    # Producer: past this fraction of the process's fd limit (RLIMIT_NOFILE), new connections are
    # closed unread and stray ones ended at once, until the count falls (back-pressure).
    fd_budget: float = 0.8
    max_wants_per_peer: int = 4096
    max_wants: int = 65536
    # Producer: a TCP connection to the listener's port that has not become a control channel after
    # this long (a raw socket UCX accepted and waits on for ever) is shut down.
    idle_connection_s: float = 10.0
    dataplane: DataPlaneConfig = DataPlaneConfig()

    def __post_init__(self) -> None:
        if self.secret is not None:
            auth.check_secret(self.secret, "TransportConfig.secret")
        _check_compat(self.compat)
        object.__setattr__(self, "compat", types.MappingProxyType(dict(self.compat)))  # frozen like the rest
        check_auth_flags(insecure_no_auth=self.insecure_no_auth, insecure_host_memory=self.insecure_host_memory,
                         secret_given=self.secret is not None, secret="a secret", name=lambda k: f"TransportConfig.{k}")
        if not isinstance(self.idle_connection_s, (int, float)) or not self.idle_connection_s > 0:
            raise ValueError(f"TransportConfig.idle_connection_s = {self.idle_connection_s!r}; expected seconds > 0")
        if not isinstance(self.fd_budget, (int, float)) or not 0 < self.fd_budget <= 1:
            raise ValueError(f"TransportConfig.fd_budget = {self.fd_budget!r}; expected a fraction of the fd limit "
                             "in (0, 1]")
        for key in ("max_handshakes", "max_handshakes_per_address", "max_wants_per_peer", "max_wants"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TransportConfig.{key} = {v!r}; expected an int >= 1")
        if isinstance(self.allowed_peers, str):
            raise ValueError(f"allowed_peers must be a tuple of addresses or networks, got the string "
                             f"{self.allowed_peers!r}")
        if self.allowed_peers:
            PeerAllowlist.parse(self.allowed_peers)  # a bad entry fails here, naming it
        if not isinstance(self.handshake_retries, int) or self.handshake_retries < 0:
            raise ValueError(f"handshake_retries {self.handshake_retries!r}; expected an int >= 0")
        if not self.handshake_backoff_s >= 0:
            raise ValueError(f"handshake_backoff_s {self.handshake_backoff_s!r}; expected seconds >= 0")

    @property
    def allowlist(self) -> PeerAllowlist | None:
        return PeerAllowlist.parse(self.allowed_peers) if self.allowed_peers else None


#: Room left in a Hello's compatibility map for the transport's own fields.
MAX_OPERATOR_COMPAT = wire.MAX_COMPAT_FIELDS - 16


def _check_compat(compat: object) -> None:
    if not isinstance(compat, Mapping):
        raise ValueError(f"TransportConfig.compat = {compat!r}; expected a mapping of str to str")
    if len(compat) > MAX_OPERATOR_COMPAT:
        raise ValueError(f"TransportConfig.compat has {len(compat)} keys; expected at most {MAX_OPERATOR_COMPAT}")
    for k, v in compat.items():
        if not isinstance(k, str) or not 0 < len(k) <= wire.MAX_COMPAT_NAME:
            raise ValueError(f"TransportConfig.compat key {k!r}; expected a str of 1..{wire.MAX_COMPAT_NAME} chars")
        if not isinstance(v, str) or len(v) > wire.MAX_NAME:
            raise ValueError(f"TransportConfig.compat[{k!r}] = {v!r}; expected a str of at most {wire.MAX_NAME} chars")


def check_auth_mode(config: TransportConfig, what: str) -> None:
    """Refuse to start an endpoint that has no secret unless lab mode was asked for by name
    (``insecure_no_auth``). Raises ValueError naming both ways out."""
    if config.secret is None and not config.insecure_no_auth and REQUIRE_SECRET:
        raise ValueError(
            f"hybridkv {what}: no TransportConfig.secret; expected a shared secret (read it with "
            "hybridkv.transport.auth.load_secret from a file `hybridkv secret FILE` wrote, or an environment "
            "variable), or insecure_no_auth=True to run unauthenticated in a lab, where any peer that reaches "
            "the port can read and write this process's registered memory")


@dataclass(frozen=True, kw_only=True)
class Result:
    request_id: str
    outcome: Outcome
    error: str | None = None
    descriptors: int | None = None  # what NIXL posted (telemetry)
    planned: int | None = None  # what the planner said NIXL would post (TransferPlan.num_descriptors)
    indices: int | None = None  # index pairs (or rows) handed to NIXL
    nbytes: int = 0
    seconds: float = 0.0  # post -> done
    post_seconds: float = 0.0  # PULL: of those, making and posting the READs (the rest is waiting)
    post_cpu_seconds: float = 0.0  # PULL, with DataPlaneConfig.telemetry: this thread's CPU in that posting
    fence_wait_seconds: float = 0.0  # export in hand -> the fence let the import post (rule 3)


@dataclass(kw_only=True)
class Stats:
    duplicates: int = 0  # completions for a transfer already terminal
    unknown: int = 0  # completions for nothing we know
    refused: int = 0  # handshakes refused
    refused_peers: int = 0  # connections closed unread: the peer is outside TransportConfig.allowed_peers
    unauthenticated: int = 0  # handshakes refused before the peer proved the shared secret (of `refused`)
    cut_off: int = 0  # peers disconnected for flooding (Wants past their share, renewals faster than answered)
    forbidden: int = 0  # messages naming a request with a token that is not its capability (of `rejected`)
    drained: int = 0  # queued UCX messages nobody would receive, discarded
    swept: int = 0  # TCP connections to the listener port ended for never becoming a channel
    fd_pressure: int = 0  # times the producer's open fds passed TransportConfig.fd_budget
    rejected: int = 0  # messages refused (malformed, unexported blocks)
    timed_out: int = 0  # transfers abandoned past their lease or the transfer timeout


__all__ = ["REQUIRE_SECRET", "FailurePolicy", "Outcome", "Pairing", "Result", "Stats", "TransportConfig", "check_auth_mode"]
