"""Import NIXL under whichever name the installed wheel uses.

The ``nixl`` meta package gives ``import nixl``; the CUDA-specific wheels
(``nixl-cu12``, ``nixl-cu13``) install ``nixl_cu12`` / ``nixl_cu13``. hybridkv
needs only the Python API (``nixl_agent``, ``nixl_agent_config``,
``nixl_thread_sync_t``), which is the same in all of them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from hybridkv.errors import MissingExtra
from hybridkv.transport.env import apply_ucx_defaults

_CANDIDATES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def load_nixl() -> ModuleType:
    """The NIXL ``_api`` module; ImportError saying how to install it otherwise. Also applies hybridkv's
    UCX defaults (:func:`hybridkv.transport.env.apply_ucx_defaults`): UCX reads them when an agent's
    backend is created, and every agent is made from the module this returns."""
    apply_ucx_defaults()
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
    raise MissingExtra("NIXL", "transport", detail="expected one of " + ", ".join(_CANDIDATES)
                       + " (a CUDA 13 host: the transport-cu13 extra). Tried: " + "; ".join(errors))
