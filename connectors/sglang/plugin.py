"""Plugin hook-up: make `hybridkv` a transfer backend SGLang can select.

SGLang 0.5.23 has no backend registry: the CLI choices are a list, the
`TransferBackend` enum is closed and `get_kv_class` is an if/elif chain. The
supported out-of-tree route is its general plugin framework: `load_plugins()`
runs every `sglang.srt.plugins` entry point before argument parsing and in
every scheduler process, then applies the registered hooks (and rebinds
`from X import name` copies). We add the CLI choice, REPLACE the enum with one
holding the original members plus ours, and wrap `get_kv_class`.
"""

from __future__ import annotations

import enum
from typing import Any

from hybridkv.connectors.sglang import BACKEND_NAME

_ENUM_TARGET = "sglang.srt.disaggregation.utils.TransferBackend"
_GET_KV_CLASS_TARGET = "sglang.srt.disaggregation.utils.get_kv_class"
_MEMBER_NAME = "HYBRIDKV"


def extended_transfer_backend(original: type[enum.Enum]) -> type[enum.Enum]:
    """The original enum's members plus ours.

    An Enum with members cannot be subclassed, so it is rebuilt. Old and new
    members are not equal to each other; code that may hold either compares
    `.value`.
    """
    if any(m.value == BACKEND_NAME for m in original):
        return original
    members = [(m.name, m.value) for m in original] + [(_MEMBER_NAME, BACKEND_NAME)]
    return enum.Enum(original.__name__, members, module=original.__module__, qualname=original.__qualname__)


def hybridkv_classes() -> dict[str, type]:
    """Our classes, keyed by `KVClassType` value. Imports SGLang (and torch)."""
    from hybridkv.connectors.sglang.conn import HybridKVBootstrapServer, HybridKVManager, HybridKVSender
    from hybridkv.connectors.sglang.receiver import HybridKVReceiver
    from sglang.srt.disaggregation.base.conn import KVArgs

    return {
        "kvargs": KVArgs,
        "manager": HybridKVManager,
        "sender": HybridKVSender,
        "receiver": HybridKVReceiver,
        "bootstrap_server": HybridKVBootstrapServer,
    }


def get_kv_class_around(original_fn: Any, transfer_backend: Any, class_type: Any) -> Any:
    """AROUND hook on `get_kv_class`: ours for `hybridkv`, the original otherwise."""
    value = getattr(transfer_backend, "value", transfer_backend)
    if value == BACKEND_NAME:
        kind = getattr(class_type, "value", class_type)
        classes = hybridkv_classes()
        if kind not in classes:
            raise ValueError(f"unknown KVClassType {class_type!r}; expected one of {sorted(classes)}")
        return classes[kind]
    # A member of the enum the REPLACE hook displaced (held by code that
    # imported it before the hooks applied) is translated by value, since the
    # chain inside get_kv_class compares against the current enum's members.
    import sglang.srt.disaggregation.utils as utils

    if isinstance(transfer_backend, enum.Enum) and not isinstance(transfer_backend, utils.TransferBackend):
        transfer_backend = utils.TransferBackend(value)
    return original_fn(transfer_backend, class_type)


def register() -> None:
    """Entry point of group `sglang.srt.plugins`; run by `load_plugins()`."""
    from hybridkv.connectors.versions import Engine, check_engine_version

    # Before any hook: SGLang logs a plugin's exception with its message and goes on without the
    # backend, so `--disaggregation-transfer-backend hybridkv` is then refused as an unknown choice.
    check_engine_version(Engine.SGLANG)
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    import sglang.srt.disaggregation.utils as utils

    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        # It is list.extend: a bare string would add one choice per letter.
        add_disagg_transfer_backend_choices([BACKEND_NAME])
    HookRegistry.register(_ENUM_TARGET, extended_transfer_backend(utils.TransferBackend), HookType.REPLACE)
    HookRegistry.register(_GET_KV_CLASS_TARGET, get_kv_class_around, HookType.AROUND)
