"""What every front end's settings share: a bad value named as that front end spells its key, and the
rules of the keys that say how a peer is authenticated.

Three front ends take these keys: :class:`~hybridkv.transport.config.TransportConfig` (``TransportConfig.x``),
the vLLM connector's ``kv_connector_extra_config`` (``kv_connector_extra_config['x']``) and the SGLang backend's
``HYBRIDKV_SGLANG_*`` environment (``x``). Each passes ``name``, its spelling of a key, so an error names the
key the operator wrote and the rule is written once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: A front end's spelling of a key in its errors.
Name = Callable[[str], str]


def require(ok: bool, name: str, value: Any, expected: str) -> None:
    """ValueError ``"<name> = <value!r>; expected <expected>"`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name} = {value!r}; expected {expected}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_auth_flags(*, insecure_no_auth: Any, insecure_host_memory: Any, secret_given: bool, secret: str,
                     name: Name) -> None:
    """The two opt-outs are bools, and lab mode (``insecure_no_auth``) never comes with a secret (``secret``:
    the secret's key(s) in words)."""
    for key, v in (("insecure_no_auth", insecure_no_auth), ("insecure_host_memory", insecure_host_memory)):
        require(isinstance(v, bool), name(key), v, "a bool")
    if insecure_no_auth and secret_given:
        raise ValueError(f"{name('insecure_no_auth')} = True with {secret}; expected one of the two (a secret "
                         "authenticates every peer, insecure_no_auth serves any)")


def check_secret_sources(*, secret_file: Any, secret_env: Any, insecure_no_auth: Any, insecure_host_memory: Any,
                         name: Name) -> None:
    """Where a connector reads the shared secret from: ``secret_file`` or ``secret_env`` (a path or a variable
    name, never the secret itself), at most one, and neither in lab mode (:func:`check_auth_flags`)."""
    for key, v in (("secret_file", secret_file), ("secret_env", secret_env)):
        require(v is None or (isinstance(v, str) and v.strip() != ""), name(key), v, "unset or a non-empty string")
    if secret_file is not None and secret_env is not None:
        raise ValueError(f"{name('secret_file')} = {secret_file!r} and {name('secret_env')} = {secret_env!r} are "
                         "both set; expected at most one source of the shared secret")
    check_auth_flags(insecure_no_auth=insecure_no_auth, insecure_host_memory=insecure_host_memory,
                     secret_given=secret_file is not None or secret_env is not None,
                     secret=f"a shared secret ({name('secret_file')} or {name('secret_env')})", name=name)


__all__ = ["Name", "check_auth_flags", "check_secret_sources", "is_int", "require"]
