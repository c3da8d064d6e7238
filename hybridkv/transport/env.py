"""hybridkv's UCX environment defaults, applied when a plane starts, never at import.

UCX reads its ``UCX_*`` variables when a context is created: ucxx's on the first
listen or dial of the control plane, NIXL's when an agent's UCX backend is
created (:class:`~hybridkv.transport.dataplane.DataPlane`, which the SGLang backend uses too). So
the defaults must be in the environment before whichever of those comes first,
and not earlier: importing hybridkv (or an engine that imports the connector)
leaves ``os.environ`` alone. Every start path calls :func:`apply_ucx_defaults`;
it only adds what is missing, so the first call is the one that matters and the
later ones are no-ops.

A variable the operator set is never overridden, whatever its value (also an
empty string: that is a choice too). One default is ucxx's own (``UCXPY_ENABLE_PYTHON_FUTURE``),
read when ucxx's context is made, at the same first listen or dial.

Note that ``import ucxx`` writes defaults of its own (``UCX_MEMTYPE_CACHE``,
``UCX_RNDV_THRESH``, ``UCX_RNDV_FRAG_MEM_TYPE``, ``UCX_MAX_RNDV_RAILS``, on
some hosts ``UCX_CUDA_COPY_MAX_REG_RATIO``), also only where unset; hybridkv
imports ucxx lazily, at the first listen or dial, so that too happens at start,
not at import (docs/environment.md lists them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from types import MappingProxyType

log = logging.getLogger(__name__)

#: UCX enables cuda_ipc READs (get_zcopy) only where NVML reports NVLink ("auto"); on PCIe hosts and
#: in VMs that hide NVLink, a pull of GPU memory then falls back to TCP software emulation. Measured on
#: one H200 VM, two processes, a 320 MB Qwen3.5-9B request: 0.5 GB/s by default, 1,223 GB/s with "on"
#: (checksums equal).
CUDA_IPC_READS_ENV = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"

#: Two UCX contexts live in one process (ucxx's for control, NIXL's for data), each parsing the whole
#: ``UCX_*`` environment; a variable meant for one (e.g. the cuda_ipc one above, or ucxx's own RNDV
#: settings) is "unused" by the other, and UCX would warn about it on every context.
WARN_UNUSED_ENV = "UCX_WARN_UNUSED_ENV_VARS"

#: A producer restarted at its address must bind its control port again while connections of its previous
#: run are still in TIME_WAIT (up to 60 s on Linux): UCX's listener binds without SO_REUSEADDR unless this
#: is set (a restarted vLLM prefill failed to listen for over 30 s without it). On Linux SO_REUSEADDR never
#: lets two live listeners share a port.
REUSE_ADDR_ENV = "UCX_TCP_CM_REUSEADDR"

#: ucxx (the control plane) waits for a request by polling it from the event loop unless its requests
#: complete Python futures (its notifier thread): every connected channel at rest waits for its next
#: frame, so polling kept a core per process busy (a connected producer and consumer at rest: 99% and
#: 98% of a core each; with futures ~5%). ucxx reads it when its context is made (first listen or
#: dial); hybridkv stops the notifier thread it brings at close and at exit (transport/ucxx_context.py).
PYTHON_FUTURE_ENV = "UCXPY_ENABLE_PYTHON_FUTURE"

#: Every UCX default hybridkv applies: variable -> value, set only where the environment lacks it.
UCX_DEFAULTS: MappingProxyType[str, str] = MappingProxyType({
    WARN_UNUSED_ENV: "n",
    CUDA_IPC_READS_ENV: "on",
    REUSE_ADDR_ENV: "y",
    PYTHON_FUTURE_ENV: "1",
})


def apply_ucx_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each of :data:`UCX_DEFAULTS` that ``environ`` (default ``os.environ``) does not set.

    Returns what this call set (empty when everything was already there). Call it on every path that
    starts a control or data plane, before its first ucxx or NIXL call."""
    env = os.environ if environ is None else environ
    applied = {k: v for k, v in UCX_DEFAULTS.items() if k not in env}
    env.update(applied)
    if applied:
        log.debug("hybridkv UCX defaults applied: %s", ", ".join(f"{k}={v}" for k, v in applied.items()))
    return applied
