"""The vLLM connector's settings: every ``kv_connector_extra_config`` key it reads, in one place.

Both halves (the scheduler process and every worker) build the same
:class:`HybridKVVllmConfig` with :meth:`HybridKVVllmConfig.from_vllm_config`, so
a key has one default and one parser, and a bad value fails at start-up naming
the key. This module does not import vLLM.
"""

from __future__ import annotations

import difflib
import enum
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from hybridkv.fencing.fence import FencePolicy
from hybridkv.transport.allowlist import PeerAllowlist
from hybridkv.transport.settings import check_secret_sources, require
from hybridkv.transport.settings import is_int as _is_int
from hybridkv.transport.staging import StagingMode

log = logging.getLogger(__name__)

#: Keys of this prefix are hybridkv's own, so one it does not know is a typo, never another
#: connector's setting: refused rather than warned about.
OWN_PREFIX = "hybridkv_"

#: vLLM 0.33 NixlConnector's own kv_connector_extra_config keys (nixl/*.py, get_from_extra_config).
#: A deployment switching from it keeps them in the same dict: accepted and ignored (logged at INFO),
#: never taken for a misspelling of ours. ``kv_lease_duration`` is shared and read by both.
NIXL_KEYS = frozenset({"backends", "bidirectional_kv_xfer", "decoder_kv_blocks_ttl", "enforce_handshake_compat",
                       "engine_ttl", "kv_recompute_threshold", "num_threads", "push_registration_timeout"})

#: NixlConnector's environment variables for what hybridkv's side_channel_* keys set (vLLM's envs.py).
#: Read as NixlConnector reads them, when the key is absent; a key that says otherwise is refused.
ENV_KEYS = {"side_channel_host": "VLLM_NIXL_SIDE_CHANNEL_HOST", "side_channel_port": "VLLM_NIXL_SIDE_CHANNEL_PORT"}

#: An unknown key this close to a known one (difflib's ratio) is a misspelling: refused, naming it.
NEAR_MISS = 0.75

#: Keys that would put the secret itself into this config, which travels on a command line.
INLINE_SECRET = frozenset({"secret", "shared_secret", "hybridkv_secret", "auth_secret"})


@dataclass(frozen=True, kw_only=True)
class HybridKVVllmConfig:
    """What ``--kv-transfer-config``'s ``kv_connector_extra_config`` may set; each field is the key of
    the same name, and its default applies when the key is absent.

    ``side_channel_host`` (str, ``"127.0.0.1"``)
        Address each prefill worker advertises in ``kv_transfer_params`` (``remote_ranks``) and
        a decode instance dials. Set it to an address decode can reach, or ``"auto"``: each
        worker advertises its own node's address (vLLM's ``VLLM_HOST_IP`` or default route), as
        a TP group spread over nodes needs. Absent: NixlConnector's ``VLLM_NIXL_SIDE_CHANNEL_HOST``
        if set; set both to different values and start-up fails, naming both.
    ``side_channel_port`` (int, ``5600``)
        Base control port: worker (TP rank) r of DP engine d listens on
        port + d x tensor_parallel_size + r, so DP engines on one host never collide. 1..65535.
        Absent: NixlConnector's ``VLLM_NIXL_SIDE_CHANNEL_PORT`` if set (as the base port), as above.
    ``kv_lease_duration`` (float seconds, ``30``)
        How long a finished request's blocks stay held for a reader that has not finished; decode
        heartbeats renew it. The scheduler hands the blocks back to vLLM only after 1.5 x this.
    ``export_timeout_s`` (float seconds, ``30``)
        Decode side: how long a worker waits for the producer's Export of a request it asked for
        before the load fails (then ``kv_load_failure_policy`` applies).
    ``allowed_peers`` (list of str, or one comma-separated str; ``()``)
        Prefill side: addresses or CIDR networks that may open a control channel. The listener is
        open on every interface (ucxx 0.52), so this keeps other networks out. Empty: any peer.
    ``allowed_producers`` (list of str, or one comma-separated str; ``()``)
        Decode side: addresses or CIDR networks of the prefill workers this decode may dial. vLLM
        accepts ``kv_transfer_params`` (``remote_host``, ``remote_ranks``) in a client's request body,
        so without it a client can make the decode dial any host; a request naming a producer
        outside it fails (``kv_load_failure_policy``) before anything is dialled, with a log line
        naming the address. Host names in a request are refused: list the producers by address.
        Empty: any producer (a warning at start-up).
    ``secret_file`` (str path or null, ``null``) / ``secret_env`` (str or null, ``null``)
        Where the shared secret both sides prove in the handshake is read from: a file, or the
        environment variable of that name (at most one of the two; the secret itself never goes in
        this config, which travels on a command line). Read once at start-up, by both halves (the
        scheduler's before vLLM loads weights); unreadable, unset or weak fails there, naming the
        key (weak: auth.check_secret; a warning instead where its ``STRICT_SECRETS`` is turned off).
        Neither: refused at start-up unless ``insecure_no_auth`` (a warning instead where the
        transport's ``REQUIRE_SECRET`` is turned off); see the README's "Security".
    ``insecure_no_auth`` (bool, ``false``)
        Lab mode, by name: run without a shared secret, so any peer that reaches a worker's port
        can read and write its registered memory. Passed to the transport (TransportConfig); the
        endpoints log it loudly and report it in their metrics. Refused together with a secret key.
    ``insecure_host_memory`` (bool, ``false``)
        With a secret and a KV cache in host memory (``kv_buffer_device: cpu``, CPU workers), a worker
        starts only where ``UCX_TLS`` leaves UCX no software transport (tcp, shm, cma: they do not bound a
        peer's READs to the registration, so a secret holder could reach the whole worker process);
        true accepts that by name (``hybridkv.transport.host_memory``). GPU caches never need it.
    ``tp_rank`` (int or null, ``null``)
        This worker's TP rank, where vLLM's distributed group does not exist (a worker built
        outside vLLM's executor, as the tests do). Null: asked of vLLM, 0 without a group.
    ``staging`` (``"off"``, ``"auto"`` or ``"on"``, ``"off"``) / ``staging_capacity_mb`` (int, ``64``)
        Heterogeneous TP (a decode instance of another TP size than the prefill's): the prefill packs
        each decode rank's head slices of a request into a slot of a staging pool and the decode
        rank reads the slot, a handful of descriptors instead of one per slice per block
        (``hybridkv.transport.staging``). ``"auto"`` stages where the descriptors saved cost more to
        post than the copies add; ``"on"`` wherever a slot holds the read. Set the same on both
        sides; each worker then registers a pool of ``staging_capacity_mb`` MiB on its KV cache's
        device, outside vLLM's memory accounting (leave that much free). Equal TP never stages.
    ``prime_reads`` (bool, ``true``)
        Decode side: once a worker asked a prefill worker for a request, it posts a READ of 256 bytes into
        a buffer of its own while it waits for the Export, so that the request's own READ finds NIXL's
        posting code warm (``hybridkv.transport.primer``; one H100: the post's CPU 83-85 us instead of
        112-162). False: no such READ.
    ``hybridkv_fence_policy`` (``"fenced"`` or ``"none"``, ``"fenced"``)
        Whether the scheduler half enforces hybridkv's fencing rules. ``"none"`` exists only to
        show what breaks without them (the race tests); never set it in a deployment.

    Keys it does not know: NixlConnector's own (``backends``, ``num_threads``, ... :data:`NIXL_KEYS`)
    are accepted and ignored, so a deployment switches from it without editing its dict. A
    ``hybridkv_*`` key, one within a misspelling of a known key ("did you mean ``secret_file``?",
    difflib) and one that would hold the secret itself are refused at start-up; any other is logged as
    a warning and ignored.
    """

    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5600
    kv_lease_duration: float = 30.0
    export_timeout_s: float = 30.0
    allowed_peers: tuple[str, ...] = ()
    allowed_producers: tuple[str, ...] = ()
    secret_file: str | None = None
    secret_env: str | None = None
    tp_rank: int | None = None
    insecure_no_auth: bool = False
    insecure_host_memory: bool = False
    staging: StagingMode = StagingMode.OFF
    staging_capacity_mb: int = 64
    prime_reads: bool = True
    hybridkv_fence_policy: FencePolicy = FencePolicy.FENCED

    def __post_init__(self) -> None:
        # The same checks whether built from vLLM's dict or directly (tests, other front ends).
        _check(isinstance(self.side_channel_host, str) and self.side_channel_host.strip() != "",
               "side_channel_host", self.side_channel_host, "a non-empty host name or address")
        _check(_is_int(self.side_channel_port) and 0 < self.side_channel_port < 65536,
               "side_channel_port", self.side_channel_port, "a TCP port, 1..65535")
        for key in ("kv_lease_duration", "export_timeout_s"):
            v = getattr(self, key)
            _check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
                   key, v, "a positive number of seconds")
        for key in ("allowed_peers", "allowed_producers"):
            v = getattr(self, key)
            _check(isinstance(v, tuple) and all(isinstance(p, str) for p in v),
                   key, v, "a tuple of addresses or CIDR networks")
            if v:
                try:
                    PeerAllowlist.parse(v)
                except ValueError as exc:
                    raise ValueError(f"kv_connector_extra_config[{key!r}]: {exc}") from None
        _check(self.tp_rank is None or (_is_int(self.tp_rank) and self.tp_rank >= 0),
               "tp_rank", self.tp_rank, "null or a non-negative int")
        check_secret_sources(secret_file=self.secret_file, secret_env=self.secret_env,
                             insecure_no_auth=self.insecure_no_auth, insecure_host_memory=self.insecure_host_memory,
                             name=_name)
        _check(isinstance(self.staging, StagingMode), "staging", self.staging, "a StagingMode")
        _check(_is_int(self.staging_capacity_mb) and 1 <= self.staging_capacity_mb <= 65536, "staging_capacity_mb",
               self.staging_capacity_mb, "an int of MiB, 1..65536")
        _check(isinstance(self.prime_reads, bool), "prime_reads", self.prime_reads, "a bool")
        _check(isinstance(self.hybridkv_fence_policy, FencePolicy), "hybridkv_fence_policy",
               self.hybridkv_fence_policy, "a FencePolicy")

    def secret(self) -> bytes | None:
        """The shared secret, read from its file or environment variable (None: unauthenticated)."""
        from hybridkv.transport.auth import load_configured_secret

        return load_configured_secret(file=self.secret_file, env=self.secret_env, key=_name)

    def staging_config(self):
        """The transport's staging config for this worker (None: no pool, never stage)."""
        from hybridkv.transport.staging import StagingConfig

        if self.staging is StagingMode.OFF:
            return None
        return StagingConfig(mode=self.staging, capacity_bytes=self.staging_capacity_mb << 20)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None,
                          env: Mapping[str, str] | None = None) -> HybridKVVllmConfig:
        """Parse ``kv_connector_extra_config`` (absent keys take NixlConnector's environment variables
        where it has one, :data:`ENV_KEYS`, then the defaults above). ``env``: the process environment
        unless given."""
        extra = {} if extra is None else extra
        if not isinstance(extra, Mapping):
            raise ValueError(f"kv_connector_extra_config = {extra!r}; expected a JSON object")
        env = os.environ if env is None else env
        known = set(cls.keys())
        unknown = sorted(str(k) for k in extra if k not in known and k not in NIXL_KEYS)
        ours = [k for k in unknown if k.startswith(OWN_PREFIX)]
        if ours:
            raise ValueError(f"kv_connector_extra_config has unknown hybridkv key(s) {ours}; "
                             f"expected one of {sorted(known)}")
        inline = [k for k in unknown if k.lower() in INLINE_SECRET]
        if inline:
            raise ValueError(f"kv_connector_extra_config[{inline[0]!r}]: the shared secret never goes in this config "
                             "(it travels on a command line); expected 'secret_file' or 'secret_env' naming where "
                             "to read it")
        for k in unknown:
            near = difflib.get_close_matches(k, sorted(known | NIXL_KEYS), n=1, cutoff=NEAR_MISS)
            if near:
                whose = "a NixlConnector key hybridkv ignores" if near[0] in NIXL_KEYS else "hybridkv's key"
                raise ValueError(f"kv_connector_extra_config has unknown key {k!r}; did you mean `{near[0]}` "
                                 f"({whose})?")
        if unknown:
            log.warning("HybridKVConnector ignores kv_connector_extra_config key(s) %s; it reads %s",
                        unknown, sorted(known))
        nixl = sorted(k for k in extra if k in NIXL_KEYS)
        if nixl:
            log.info("HybridKVConnector ignores NixlConnector's kv_connector_extra_config key(s) %s", nixl)
        extra = dict(extra)
        for key, var in ENV_KEYS.items():
            value = env.get(var)
            if value is None:
                continue
            parse = _host if key == "side_channel_host" else _int
            try:
                parsed = parse(var, value)
            except ValueError:
                raise ValueError(f"environment variable {var} = {value!r} (NixlConnector's, read for hybridkv's "
                                 f"{key!r}); expected {'a host name or address' if parse is _host else 'a TCP port'}"
                                 ) from None
            if key not in extra:
                extra[key] = parsed
            elif parsed != parse(key, extra[key]):
                raise ValueError(f"kv_connector_extra_config[{key!r}] = {extra[key]!r} and the environment's "
                                 f"{var} = {value!r} disagree; expected one of them, or the same value")
        parsers = {
            "side_channel_host": _host,
            "side_channel_port": _int,
            "kv_lease_duration": _seconds,
            "export_timeout_s": _seconds,
            "allowed_peers": _peers,
            "allowed_producers": _peers,
            "secret_file": _optional_str,
            "secret_env": _optional_str,
            "tp_rank": _optional_int,
            "insecure_no_auth": _bool,
            "insecure_host_memory": _bool,
            "prime_reads": _bool,
            "staging": _choice(StagingMode),
            "staging_capacity_mb": _int,
            "hybridkv_fence_policy": _choice(FencePolicy),
        }
        return cls(**{k: parsers[k](k, extra[k]) for k in cls.keys() if k in extra})

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> HybridKVVllmConfig:
        """From a ``VllmConfig``: its ``kv_transfer_config.kv_connector_extra_config``. Both halves build it
        first, so from here on hybridkv's logs follow vLLM's logging set-up (logs.py)."""
        from hybridkv.connectors.vllm.logs import follow_vllm_logging

        follow_vllm_logging()
        parallel = getattr(vllm_config, "parallel_config", None)
        for key in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
            n = getattr(parallel, key, 1)
            if n != 1:
                # Each worker adopts and serves its own TP shard of every layer; a PP stage holds only
                # some layers and a context-parallel rank only some tokens, which no pairing covers.
                raise ValueError(f"HybridKVConnector does not support {key} = {n}; expected 1 "
                                 "(use tensor and data parallelism)")
        kvt = getattr(vllm_config, "kv_transfer_config", None)
        if kvt is None:
            raise ValueError("vllm_config.kv_transfer_config is None; expected a KVTransferConfig "
                             "naming HybridKVConnector")
        _check_buffer_device(getattr(kvt, "kv_buffer_device", None))
        cfg = cls.from_extra_config(kvt.kv_connector_extra_config)
        # A secret key that cannot be used, or no secret without lab mode by name, stops this half at
        # start-up, whichever half it is (the scheduler's before vLLM loads weights).
        cfg.check_auth_mode(cfg.secret())
        return cfg

    def check_auth_mode(self, secret: bytes | None) -> None:
        """No secret: start only in lab mode, asked for by name (``insecure_no_auth``), and say so
        loudly; without it, refused (a warning where the transport's ``REQUIRE_SECRET`` is turned off)."""
        from hybridkv.transport import config as transport_config

        if secret is not None:
            return
        if self.insecure_no_auth:
            log.warning("INSECURE: HybridKVConnector runs in lab mode (kv_connector_extra_config 'insecure_no_auth': "
                        "true): no shared secret, so any peer that reaches a worker's side-channel port gets its "
                        "NIXL metadata and can read and write its registered memory (docs/security.md)")
            return
        message = ("HybridKVConnector has no shared secret: kv_connector_extra_config sets neither 'secret_file' nor "
                   "'secret_env'; expected one of them, naming where a secret `hybridkv secret FILE` made is read "
                   "(the same on every prefill and decode instance), or 'insecure_no_auth': true to run "
                   "unauthenticated in a lab, where any peer that reaches a worker's port can read and write its "
                   "registered memory")
        if transport_config.REQUIRE_SECRET:
            raise ValueError(message)
        log.warning("%s (refused once hybridkv.transport.config.REQUIRE_SECRET is on)", message)


def _check_buffer_device(device: str | None) -> None:
    """hybridkv reads and writes the KV cache where vLLM allocated it (pull, in place): the only buffer
    device it honours is that one. NixlConnector's host staging buffer (``kv_buffer_device='cpu'`` on a
    GPU) is refused rather than silently ignored."""
    from vllm.platforms import current_platform  # only from_vllm_config gets here: vLLM is there

    own = current_platform.device_type
    if device is not None and device != own:
        raise ValueError(f"kv_transfer_config.kv_buffer_device = {device!r}; HybridKVConnector moves the KV cache "
                         f"in place in {own!r} memory and has no staging buffer: expected {own!r} (vLLM's default)")


def _name(key: str) -> str:
    return f"kv_connector_extra_config[{key!r}]"


def _check(ok: bool, key: str, value: Any, expected: str) -> None:
    require(ok, _name(key), value, expected)


# The parsers accept what the keys' earlier int()/float() reads accepted from JSON (numbers, and
# numbers written as strings, as templated configs do), and nothing looser: no bools, no 5600.5.
def _host(key: str, v: Any) -> str:
    _check(isinstance(v, str) and v.strip() != "", key, v, "a non-empty host name or address")
    return v.strip()


def _int(key: str, v: Any) -> int:
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            pass
    elif isinstance(v, float) and v.is_integer():
        return int(v)
    _check(_is_int(v), key, v, "an int")
    return v


def _optional_str(key: str, v: Any) -> str | None:
    _check(v is None or isinstance(v, str), key, v, "null or a string")
    return None if v is None else v.strip()


def _optional_int(key: str, v: Any) -> int | None:
    return None if v is None else _int(key, v)


def _seconds(key: str, v: Any) -> float:
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            pass
    _check(isinstance(v, (int, float)) and not isinstance(v, bool), key, v, "a positive number of seconds")
    return float(v)


def _peers(key: str, v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        return tuple(p.strip() for p in v.split(",") if p.strip())
    _check(isinstance(v, (list, tuple)) and all(isinstance(p, str) for p in v), key, v,
           "a list of addresses/CIDR networks or one comma-separated string")
    return tuple(p.strip() for p in v)


def _bool(key: str, v: Any) -> bool:
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    _check(isinstance(v, bool), key, v, "true or false")
    return v


def _choice(kind: type[enum.Enum]) -> Callable[[str, Any], Any]:
    """A parser of one member of ``kind``, given as itself or by its value (any case)."""
    def parse(key: str, v: Any) -> Any:
        if isinstance(v, kind):
            return v
        by_value = {m.value: m for m in kind}
        _check(isinstance(v, str) and v.strip().lower() in by_value, key, v, f"one of {sorted(by_value)}")
        return by_value[v.strip().lower()]
    return parse
