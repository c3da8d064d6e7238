"""Import NIXL under whichever name the installed wheel uses.

The ``nixl`` meta package gives ``import nixl``; the CUDA-specific wheels
(``nixl-cu12``, ``nixl-cu13``) install ``nixl_cu12`` / ``nixl_cu13``. hybridkv
needs only the Python API (``nixl_agent``, ``nixl_agent_config``,
``nixl_thread_sync_t``), which is the same in all of them.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

_CANDIDATES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


#: UCX enables cuda_ipc READs (get_zcopy) only where NVML reports NVLink ("auto"); on PCIe hosts and
#: in VMs that hide NVLink, a pull of GPU memory then falls back to TCP software emulation. Measured on
#: one H200 VM, two processes, a 320 MB Qwen3.5-9B request: 0.5 GB/s by default, 1,223 GB/s with "on"
#: (checksums equal). A value the operator set (e.g. "auto") is kept.
CUDA_IPC_READS_ENV = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"


def prefer_cuda_ipc_reads() -> None:
    """Turn cuda_ipc READs on unless the environment already says; UCX reads it when an agent's
    backend is created, so this runs before any agent exists (``load_nixl`` calls it)."""
    os.environ.setdefault(CUDA_IPC_READS_ENV, "on")


def load_nixl() -> ModuleType:
    """The NIXL ``_api`` module; ImportError saying how to install it otherwise. Also sets
    hybridkv's UCX defaults (:func:`prefer_cuda_ipc_reads`)."""
    prefer_cuda_ipc_reads()
    errors = []
    for name in _CANDIDATES:
        try:
            mod = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if hasattr(mod, "nixl_agent") and hasattr(mod, "nixl_agent_config"):
            return mod
        errors.append(f"{name}: has no nixl_agent")
    raise ImportError(
        "NIXL is not installed; expected one of " + ", ".join(_CANDIDATES)
        + " (pip install 'hybridkv[transport]' or nixl-cu12 / nixl-cu13 matching torch's CUDA major). Tried: "
        + "; ".join(errors)
    )
