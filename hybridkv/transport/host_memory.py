"""Host memory in authenticated mode: refused where UCX may serve it over a software transport.

NIXL checks a transfer against the initiator's own copy of the target's registration. Over UCX's
software RMA (tcp, and on one host shm/posix/sysv, cma, xpmem, knem) the target serves whatever
address a request names, so a peer that edits its copy of the metadata READs and WRITEs any address
of the producer process: its heap, the shared secret, everything (measured: docs/security.md, "What a
secret holder can reach"). Over RDMA verbs the NIC bounds a request to the registered span; over
cuda_ipc the driver bounds it to the CUDA allocation.

So with a secret (authenticated mode), an endpoint that registers host memory starts only where
``UCX_TLS`` leaves UCX no software transport (e.g. ``UCX_TLS=rc,cuda_ipc``), or where the operator
accepts by name that every secret holder can reach the whole process (``insecure_host_memory``, the
counterpart of lab mode's ``insecure_no_auth``). Without a secret the endpoint is in lab mode, which
already hands any peer that reaches its port the same reach.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: UCX transport names (and the aliases that include them) that serve RMA in software, unbounded.
SOFTWARE_RMA = frozenset({"tcp", "sm", "shm", "posix", "sysv", "cma", "xpmem", "knem"})

#: What UCX may pick when ``UCX_TLS`` is unset or ``all``: every transport the build has.
_ALL = ("tcp", "shm", "cma")


def software_transports(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The software RMA transports ``UCX_TLS`` leaves UCX (empty: only hardware-bounded ones)."""
    env = os.environ if environ is None else environ
    raw = env.get("UCX_TLS", "").strip()
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    if not names or names == ["all"]:
        return _ALL
    if names[0].startswith("^"):  # an exclusion list: everything but these
        excluded = {names[0][1:], *names[1:]}
        if "sm" in excluded or "shm" in excluded:
            excluded |= {"posix", "sysv", "cma", "xpmem", "knem", "shm", "sm"}
        return tuple(n for n in _ALL if n not in excluded)
    return tuple(n for n in names if n in SOFTWARE_RMA)


def check_host_memory(*, authenticated: bool, host_memory: bool, accepted: bool, what: str, opt_in: str,
                      environ: Mapping[str, str] | None = None) -> None:
    """Refuse an authenticated endpoint that registers host memory UCX may serve in software, unless the
    operator accepted it (``opt_in`` names how). Raises ValueError naming the transports and both ways out."""
    if not authenticated or not host_memory or accepted:
        return
    soft = software_transports(environ)
    if not soft:
        return
    tls = (environ if environ is not None else os.environ).get("UCX_TLS")
    raise ValueError(
        f"hybridkv {what}: host-memory KV cache with a shared secret, and UCX may serve it over "
        f"{', '.join(soft)} (UCX_TLS={tls!r}): those transports do not bound a peer's READs and WRITEs to the "
        "registration, so every secret holder could reach this whole process (docs/security.md); expected "
        f"UCX_TLS naming only RDMA verbs or GPU transports (e.g. UCX_TLS=rc,cuda_ipc), or {opt_in} to accept that "
        "every secret holder is as trusted as this process")


__all__ = ["SOFTWARE_RMA", "check_host_memory", "software_transports"]
