"""Settings of the hybridkv SGLang backend: defaults here, environment read once, here."""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from hybridkv.transport import config as transport_config
from hybridkv.transport.allowlist import PeerAllowlist, canonical_ip
from hybridkv.transport.auth import load_configured_secret
from hybridkv.transport.dataplane import DataPlaneConfig
from hybridkv.transport.settings import check_secret_sources, is_int, require
from hybridkv.transport.staging import StagingConfig, StagingMode

logger = logging.getLogger(__name__)

_ENV_PREFIX = "HYBRIDKV_SGLANG_"
# SGLang's NIXL backend settings, read as SGLang reads them (its envs: the same names and defaults)
NIXL_BACKEND_VAR = "SGLANG_DISAGGREGATION_NIXL_BACKEND"
NIXL_PARAMS_VAR = "SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS"
PREFILL_UCX_THREADS = 8  # SGLang's NIXL backend: a prefill agent posts with 8 UCX threads, a decode agent with none
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_SECRET_KEYS = frozenset({"secret_file", "secret_env"})
_INT_KEYS = frozenset({"workers", "max_sessions"})
_STAGING_UNIT = 4 << 10  # a pool slot's allocation unit (a request's slice of a few pages is a few KB)
_MODE_KEYS = frozenset({"staging"})
_BOOL_KEYS = frozenset({"progress_thread", "insecure_no_auth", "insecure_host_memory"})
_HOSTS_KEYS = frozenset({"allowed_decode_hosts"})
_AUTH_KEYS = _SECRET_KEYS | {"insecure_no_auth", "insecure_host_memory"}  # hybridkv.transport.settings checks them


@dataclass(frozen=True, kw_only=True)
class SGLangConfig:
    """One manager's settings. Each key can be set by the environment variable
    ``HYBRIDKV_SGLANG_<KEY>`` (upper case), read once by :meth:`from_server_args`.

    Keys:

    * ``transfer_timeout_s`` (30): how long a prefill chunk's WRITEs may run before
      they are aborted (never past the room's export lease).
    * ``drain_timeout_s`` (unset): how long a decode room whose prefill failed waits
      for every writer to say it is quiet before its pages are released anyway.
      Unset: SGLang's deferred decode KV release timeout
      (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``, 30 s), after
      which SGLang frees a held request's pages whatever the backend says; set
      longer than that, the decode manager refuses to start (startup.py). With
      that release off (decode TP 1 only), SGLang's waiting timeout
      (``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, 300 s); a prefill manager uses
      300 s (its lease).
    * ``min_lease_s`` (60): the shortest export/import lease of the fencing
      scheduler; the lease is the larger of this and the drain timeout.
    * ``workers`` (4): prefill threads that post and settle chunks. Chunks queue per
      decode peer (a room's in order) and a stalled decode holds one thread, so up to
      ``workers - 1`` stalled decodes delay no other decode.
    * ``poll_interval_s`` (0.2): how often the control threads wake without a
      message (stop flag, lease expiry, stuck writes).
    * ``settle_poll_s`` (0.0005): how often a worker polls the WRITEs it waits for.
    * ``progress_thread`` (true): NIXL's progress thread. The decode agent is only
      ever a write target and nothing else progresses it.
    * ``secret_file`` / ``secret_env`` (unset): where the shared secret prefill and
      decode ranks prove before any NIXL metadata travels is read from: a file, or the
      environment variable of that name (at most one; 32 random bytes, as `hybridkv secret` makes). The secret
      itself is never a value of these keys: they name where it is. Neither: the
      backend runs unauthenticated and warns at start-up (a lab); once hybridkv's
      transport requires a secret (``hybridkv.transport.config.REQUIRE_SECRET``), only
      with ``insecure_no_auth``.
    * ``insecure_no_auth`` (false): lab mode by name, hybridkv's transport's
      ``TransportConfig.insecure_no_auth``: no secret, and any process that reaches a
      rank's ZMQ port can have KV written into memory it controls. Refused together
      with a secret.
    * ``insecure_host_memory`` (false): with a secret, a rank whose registered buffers include host
      memory (CPU pools; SGLang's metadata buffers are host memory on GPU servers too) starts only where
      ``UCX_TLS`` leaves UCX no software transport (e.g. ``UCX_TLS=rc,cuda_ipc,cuda_copy``): tcp, shm and
      cma do not bound a peer's WRITEs and READs to the registration, so a secret holder could reach the
      whole rank process. True accepts that by name (``hybridkv.transport.host_memory``).
    * ``handshake_timeout_s`` (5): how long a decode rank waits for a prefill rank to
      answer its authentication handshake before the request fails.
    * ``max_sessions`` (256): proven decode ranks a prefill rank keeps a session with.
      Past it the oldest session ends: its NIXL agent is removed once no write to it is
      in flight, and the rooms it claimed fail.
    * ``allowed_decode_hosts`` (unset): the IP addresses or networks (comma-separated,
      ``10.0.0.0/8,192.168.1.7``) a prefill rank answers a decode's handshake at. Unset:
      only the address the handshake came from, so a Hello cannot make the rank dial a
      third host; set it where a decode host names another address than the one it
      sends from (several NICs).
    * ``staging`` (off): KV at different attention TP through a staging slot (staged_kv.py) instead of one
      descriptor per head slice of every token of every layer: ``on`` wherever a slot is free, ``auto`` where
      the descriptors it saves cost more to post than the copies it adds (hybridkv.transport.staging.route),
      ``off`` never. Both sides of a pair read it; a full pool falls back to the sliced lists, never waits.
    * ``staging_pool_mb`` (64): each rank's staging pool (host or device memory, like its KV pool), registered
      with NIXL, in slots of 4 KiB units; only allocated with ``staging`` not off.
    """

    transfer_timeout_s: float = 30.0
    drain_timeout_s: float | None = None
    min_lease_s: float = 60.0
    workers: int = 4
    poll_interval_s: float = 0.2
    settle_poll_s: float = 0.0005
    progress_thread: bool = True
    secret_file: str | None = None
    secret_env: str | None = None
    handshake_timeout_s: float = 5.0
    max_sessions: int = 256
    insecure_no_auth: bool = False
    insecure_host_memory: bool = False
    allowed_decode_hosts: tuple[str, ...] = ()
    staging: StagingMode = StagingMode.OFF
    staging_pool_mb: float = 64.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in _HOSTS_KEYS:
                require(isinstance(v, tuple) and all(isinstance(h, str) for h in v), f.name, v,
                        "a tuple of IP addresses or networks")
                if v:
                    try:
                        PeerAllowlist.parse(v)  # the transport's allowlist: the same rule as allowed_peers
                    except ValueError as e:
                        raise ValueError(f"{f.name}: {e}") from None
            elif f.name in _MODE_KEYS:
                require(isinstance(v, StagingMode), f.name, v, f"one of {[m.value for m in StagingMode]}")
            elif f.name in _AUTH_KEYS:
                continue  # the core's rules, below
            elif f.name in _BOOL_KEYS:
                require(isinstance(v, bool), f.name, v, "a bool")
            elif f.name in _INT_KEYS:
                require(is_int(v) and v >= 1, f.name, v, "an int >= 1")
            elif v is not None or f.name != "drain_timeout_s":
                require((is_int(v) or isinstance(v, float)) and v > 0, f.name, v, "a number > 0")
        check_secret_sources(secret_file=self.secret_file, secret_env=self.secret_env,
                             insecure_no_auth=self.insecure_no_auth, insecure_host_memory=self.insecure_host_memory,
                             name=str)

    def secret(self) -> bytes | None:
        """The shared secret, read from its file or environment variable now (None: unauthenticated).
        ValueError naming the key and what is wrong (unreadable, unset, weak: auth.check_secret), or, where
        hybridkv's transport requires a secret, that neither it nor ``insecure_no_auth`` is set."""
        if self.secret_file is None and self.secret_env is None:
            if not self.insecure_no_auth and transport_config.REQUIRE_SECRET:
                raise ValueError(f"hybridkv SGLang backend: no shared secret ({_ENV_PREFIX}SECRET_FILE or "
                                 f"{_ENV_PREFIX}SECRET_ENV); expected one, or {_ENV_PREFIX}INSECURE_NO_AUTH=1 to run "
                                 "unauthenticated in a lab, where any process that reaches a rank's port can have KV "
                                 "written into memory it controls")
        return load_configured_secret(file=self.secret_file, env=self.secret_env, key=lambda k: _ENV_PREFIX + k.upper())

    @classmethod
    def from_server_args(cls, server_args: Any = None, environ: Mapping[str, str] = os.environ) -> SGLangConfig:
        """Defaults, overridden by ``HYBRIDKV_SGLANG_*`` variables; ValueError naming a
        variable whose value does not parse. ``server_args`` (SGLang's ``ServerArgs``)
        carries nothing of ours yet: the signature is where a CLI flag would come in."""
        del server_args
        values: dict[str, Any] = {}
        for f in fields(cls):
            var = _ENV_PREFIX + f.name.upper()
            raw = environ.get(var)
            if raw is None or raw.strip() == "":
                continue
            values[f.name] = _parse(var, raw.strip(), f.name)
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"{e} (from the {_ENV_PREFIX}* environment)") from None

    def staging_config(self) -> StagingConfig | None:
        """The staging pool's settings (None: staging off, no pool)."""
        if self.staging is StagingMode.OFF:
            return None
        units = max(1, int(self.staging_pool_mb * (1 << 20)) // _STAGING_UNIT)
        return StagingConfig(mode=self.staging, capacity_bytes=units * _STAGING_UNIT, slot_bytes=_STAGING_UNIT)

    def drain_timeout(self, sglang_waiting_timeout: float | None) -> float:
        return self.drain_timeout_s if self.drain_timeout_s is not None else float(sglang_waiting_timeout or 300.0)

    def lease_s(self, drain_timeout_s: float) -> float:
        return max(drain_timeout_s, self.min_lease_s)

    def decode_host_allowed(self, ip: str, source: str | None) -> bool:
        """Whether a prefill rank may send a handshake reply to a decode naming `ip`, from a message that came
        from `source` (the sending connection's IP; None: unknown)."""
        named = _ip(ip)
        if named is None:
            return False
        if self._decode_hosts is not None:
            return self._decode_hosts.allows(str(named))
        return source is not None and named == _ip(source)

    @functools.cached_property
    def _decode_hosts(self) -> PeerAllowlist | None:
        return PeerAllowlist.parse(self.allowed_decode_hosts) if self.allowed_decode_hosts else None

    def dataplane(self, *, prefill: bool = False, ib_device: str | None = None, gpu_id: int = 0,
                  environ: Mapping[str, str] = os.environ) -> DataPlaneConfig:
        """The data plane of a rank, NIC and UCX settings as SGLang's NIXL backend takes them: the UCX backend
        parameters of ``SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS`` (a JSON object of strings), 8 UCX threads
        on a prefill rank unless they name ``num_threads``, and the NICs ``--disaggregation-ib-device`` maps
        this rank's GPU to as UCX's ``device_list`` (not where ``UCX_NET_DEVICES`` is set: UCX takes that).
        ValueError naming the setting for a backend other than UCX, parameters that do not parse, or a
        ``device_list`` that contradicts the flag."""
        backend = (environ.get(NIXL_BACKEND_VAR) or "UCX").strip()
        if backend != "UCX":
            raise ValueError(f"{NIXL_BACKEND_VAR}={backend!r}: hybridkv's SGLang backend moves bytes over NIXL's UCX "
                             "backend only; expected UCX (or unset)")
        raw = environ.get(NIXL_PARAMS_VAR) or "{}"
        try:
            given = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{NIXL_PARAMS_VAR}={raw!r} is not JSON ({e}); expected a JSON object of strings") from None
        if not isinstance(given, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in given.items()):
            raise ValueError(f"{NIXL_PARAMS_VAR}={raw!r}; expected a JSON object with string keys and values")
        # "peer" error handling makes a WRITE to a dead process fail instead of hang (the operator may override)
        params = {"ucx_error_handling_mode": "peer", **given}
        if prefill:
            params.setdefault("num_threads", str(PREFILL_UCX_THREADS))
        if ib_device:
            if environ.get("UCX_NET_DEVICES"):
                logger.warning("hybridkv: UCX_NET_DEVICES is set; --disaggregation-ib-device is not applied (UCX "
                               "takes UCX_NET_DEVICES)")
            elif (devices := ucx_device_list(ib_device, gpu_id)) is not None:
                if "device_list" in params and _device_names(params["device_list"]) != devices:
                    raise ValueError(f"{NIXL_PARAMS_VAR} names device_list={params['device_list']!r} and "
                                     f"--disaggregation-ib-device maps GPU {gpu_id} to {devices!r}; expected one "
                                     "of the two, or both the same")
                params["device_list"] = devices
                logger.info("hybridkv: GPU %s bound to NIC(s) %s (UCX device_list)", gpu_id, devices)
        # NIXL's own defaults for an engine agent otherwise (progress thread on, no telemetry); no primer: the
        # decode's READs go out from SGLang's own transfer path, never through a Consumer's Want
        return DataPlaneConfig(progress_thread=self.progress_thread, telemetry=False,
                               ucx_params=tuple(params.items()), prime=False)


def ucx_device_list(ib_device: str, gpu_id: int) -> str | None:
    """The NICs ``--disaggregation-ib-device`` gives GPU `gpu_id` (SGLang's own parser: a list for every GPU, a
    {gpu: list} map, or a JSON file of one), as NIXL's UCX ``device_list`` takes them ("mlx5_0, mlx5_1"; NIXL
    adds the port); None if it names none."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import get_ib_devices_for_gpu

    devices = get_ib_devices_for_gpu(ib_device, gpu_id)
    if devices is None:
        return None
    names = _device_names(devices)
    if any(not n or ":" in n for n in names.split(", ")):
        raise ValueError(f"--disaggregation-ib-device {ib_device!r} gives GPU {gpu_id} {devices!r}; expected NIC "
                         "names without a port (mlx5_0, not mlx5_0:1): NIXL's UCX backend adds port 1")
    return names


def _device_names(devices: str) -> str:
    return ", ".join(n.strip() for n in devices.split(","))


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    return canonical_ip(text.strip("[]"))  # SGLang may bracket an IPv6 host


def _parse(var: str, raw: str, key: str) -> Any:
    if key in _HOSTS_KEYS:
        return tuple(h.strip() for h in raw.split(",") if h.strip())
    if key in _MODE_KEYS:
        try:
            return StagingMode(raw.lower())
        except ValueError:
            raise ValueError(f"{var}={raw!r}; expected one of {[m.value for m in StagingMode]}") from None
    if key in _SECRET_KEYS:
        return raw  # a path or a variable name, never the secret itself
    if key in _BOOL_KEYS:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(f"{var}={raw!r}; expected one of {sorted(_TRUE | _FALSE)}")
    try:
        return int(raw) if key in _INT_KEYS else float(raw)
    except ValueError:
        raise ValueError(f"{var}={raw!r}; expected {'an int' if key in _INT_KEYS else 'a number'}") from None
