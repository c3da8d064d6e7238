"""Plugin hook-up: make `hybridkv` a transfer backend SGLang can select.

SGLang 0.5.23 has no backend registry: the CLI choices are a list, the
`TransferBackend` enum is closed and `get_kv_class` is an if/elif chain. The
supported out-of-tree route is its general plugin framework: `load_plugins()`
runs every `sglang.srt.plugins` entry point before argument parsing and in
every scheduler process, then applies the registered hooks (and rebinds
`from X import name` copies). We add the CLI choice, add our member to the enum
in place, and wrap `get_kv_class`.

The plugin runs in every process where hybridkv is installed, whichever backend
is chosen. So the enum is not replaced (a rebuilt enum's members are new
objects: every member imported before the plugin loaded, e.g. a default in a
module that compares ``backend == TransferBackend.NIXL``, stopped comparing
equal to the ones SGLang looked up afterwards); it keeps its class and members
and gains one more, which only ``TransferBackend("hybridkv")`` reaches.
"""

from __future__ import annotations

import enum
from typing import Any

from hybridkv.connectors.sglang import BACKEND_NAME

_GET_KV_CLASS_TARGET = "sglang.srt.disaggregation.utils.get_kv_class"
_MEMBER_NAME = "HYBRIDKV"


def add_member(enum_cls: type[enum.Enum], name: str, value: Any) -> enum.Enum:
    """Add a member to an Enum class in place and return it (the existing one if `value` is a member).

    An Enum with members cannot be subclassed, and a rebuilt one would leave every member held from before
    unequal to its own: so the member is made as the class makes its own (a plain Enum; SGLang's
    TransferBackend is one) and entered where the class looks members up, by name, by value and in order.
    """
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    if name in enum_cls._member_map_:
        raise ValueError(f"{enum_cls.__name__}.{name} is already {enum_cls._member_map_[name]!r}; expected a new name")
    if enum_cls._member_type_ is not object:
        raise TypeError(f"{enum_cls.__name__} mixes in {enum_cls._member_type_.__name__}; expected a plain Enum")
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    add = getattr(enum_cls, "_add_member_", None)  # Python 3.13+: the class's own way in
    if add is not None:
        add(name, member)
    else:
        type.__setattr__(enum_cls, name, member)
        enum_cls._member_map_[name] = member
    if name not in enum_cls._member_names_:
        enum_cls._member_names_.append(name)
    enum_cls._value2member_map_[value] = member
    return member


def hybridkv_classes() -> dict[str, type]:
    """Our classes, keyed by `KVClassType` value. Imports SGLang (and torch)."""
    from hybridkv.connectors.sglang.bootstrap import HybridKVBootstrapServer
    from hybridkv.connectors.sglang.conn import HybridKVManager
    from hybridkv.connectors.sglang.receiver import HybridKVReceiver
    from hybridkv.connectors.sglang.sender import HybridKVSender
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
        transfer_backend = utils.TransferBackend(value)  # (another plugin's enum, should one replace it)
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
    add_member(utils.TransferBackend, _MEMBER_NAME, BACKEND_NAME)
    HookRegistry.register(_GET_KV_CLASS_TARGET, get_kv_class_around, HookType.AROUND)
