"""The engine versions each connector was tested against, checked when the connector loads.

The connectors reach into engine internals (vLLM's scheduler and KV cache manager, SGLang's
disaggregation classes) that change between minor releases. Another patch release of the tested
minor version is let through with a warning; another minor or major version is refused with both
versions named, before the engine starts serving on a contract nobody checked.
"""

from __future__ import annotations

import enum
import logging
import re
from importlib import metadata

log = logging.getLogger(__name__)


class Engine(enum.Enum):
    VLLM = "vllm"
    SGLANG = "sglang"


#: What tests/vllm and tests/sglang run against (scripts/setup_vllm.sh, scripts/setup_sglang.sh).
TESTED = {Engine.VLLM: "0.33.0", Engine.SGLANG: "0.5.23"}

_RELEASE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


class UntestedEngineVersion(RuntimeError):
    """The installed engine is not a release of the minor version this connector was tested with."""


def _release(version: str) -> tuple[int, int, int]:
    m = _RELEASE.match(version)
    if m is None:
        raise ValueError(f"engine version {version!r}; expected MAJOR.MINOR[.PATCH]")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def check_engine_version(engine: Engine, installed: str | None = None) -> None:
    """Refuse an engine of another minor version than the tested one; warn on another patch release.

    ``installed`` defaults to the installed distribution's version."""
    tested = TESTED[engine]
    if installed is None:
        installed = metadata.version(engine.value)
    have, want = _release(installed), _release(tested)
    if have[:2] != want[:2]:
        raise UntestedEngineVersion(
            f"hybridkv's {engine.value} connector was tested with {engine.value}=={tested}; {installed} is "
            f"installed. The connector uses {engine.value} internals that change between minor releases: "
            f"install {engine.value}=={tested}, or a hybridkv built for {installed}.")
    if installed != tested:
        log.warning("hybridkv's %s connector was tested with %s==%s; %s is installed (same minor release)",
                    engine.value, engine.value, tested, installed)
