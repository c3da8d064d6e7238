"""hybridkv's UCX defaults: applied when a control or data plane starts, before its UCX context, never at
import and never over the operator's own setting; every environment variable documented."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.transport.env import UCX_DEFAULTS, apply_ucx_defaults

ROOT = Path(__file__).resolve().parents[2]


def _clean_env(**preset: str) -> dict[str, str]:
    """This environment without any of hybridkv's defaults, plus ``preset``."""
    env = {k: v for k, v in os.environ.items() if k not in UCX_DEFAULTS}
    env["PYTHONPATH"] = str(ROOT)
    return {**env, **preset}


def _run(code: str, env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()


# ------------------------------------------------------------ the function
def test_apply_sets_only_what_is_missing():
    env = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto", "OTHER": "x"}
    applied = apply_ucx_defaults(env)
    assert applied == {k: v for k, v in UCX_DEFAULTS.items() if k != "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"}
    assert env == {**UCX_DEFAULTS, "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto", "OTHER": "x"}
    assert apply_ucx_defaults(env) == {}  # the first call is the one that matters
    assert env == {**UCX_DEFAULTS, "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto", "OTHER": "x"}


def test_an_empty_setting_is_the_operators_too():
    env = {"UCX_WARN_UNUSED_ENV_VARS": ""}
    apply_ucx_defaults(env)
    assert env["UCX_WARN_UNUSED_ENV_VARS"] == ""


def test_the_defaults_are_the_documented_ones():
    assert dict(UCX_DEFAULTS) == {"UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on",
                                  "UCX_TCP_CM_REUSEADDR": "y", "UCXPY_ENABLE_PYTHON_FUTURE": "1"}


# ------------------------------------------------------------ import leaves os.environ alone
_IMPORTS = """
import os, sys
before = dict(os.environ)
import hybridkv, hybridkv.cli
import hybridkv.transport.control, hybridkv.transport.endpoint, hybridkv.transport.dataplane
import hybridkv.transport.nixl_shim, hybridkv.benchmarks.transfer.command, hybridkv.transport.env
import hybridkv.connectors.reference.serve, hybridkv.connectors.reference.demo, hybridkv.connectors.vllm.config
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print("changed", changed)
# ucxx writes UCX_* defaults of its own when imported: hybridkv imports it at the first listen or dial.
print("loaded", sorted(m for m in ("ucxx", "nixl", "nixl_cu12", "nixl_cu13") if m in sys.modules))
"""


def test_importing_hybridkv_does_not_change_os_environ():
    """In a fresh process: importing the transport (control plane, endpoints, data plane), the bench, the
    reference engine's worker and the vLLM config writes nothing, and neither ucxx nor NIXL is loaded."""
    changed, loaded = _run(_IMPORTS, _clean_env())
    assert changed == "changed []"
    assert loaded == "loaded []"


# ------------------------------------------------------------ start paths apply them, before UCX reads them
_DATA_PLANE = """
import os
from hybridkv.transport.dataplane import DataPlane
from tests.transport.peers import build
print("ENV", *(os.environ.get(k) for k in {keys!r}))
layout, memory, _ = build(1)
dp = DataPlane(memory)
print("ENV", *(os.environ.get(k) for k in {keys!r}))
dp.close()
"""

_CONTROL_PLANE = """
import asyncio, os
from hybridkv.transport import control

async def main():
    print("ENV", *(os.environ.get(k) for k in {keys!r}))
    async def handler(ch):
        await ch.close()
    listener = control.listen(handler, port=0)
    print("ENV", *(os.environ.get(k) for k in {keys!r}))
    import ucxx
    print("FUTURES", ucxx.core._ctx.enable_python_future)  # what ucxx's context made of it
    listener.close()  # and no ucxx.stop_notifier_thread(): the process must still exit

asyncio.run(main())
"""


@pytest.mark.parametrize("probe", [_DATA_PLANE, _CONTROL_PLANE], ids=["data-plane", "control-plane"])
@pytest.mark.parametrize("preset", [{}, {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto", "UCX_WARN_UNUSED_ENV_VARS": "y"},
                                    {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "off"}, {"UCXPY_ENABLE_PYTHON_FUTURE": "0"}],
                         ids=["unset", "operator-set", "one-set", "futures-off"])
def test_a_starting_plane_applies_the_defaults_unless_set(probe, preset):
    """Whichever plane starts first (each creates a UCX context, which reads the variables then) finds them
    set; nothing was set before it started; what the operator set stays."""
    keys = tuple(UCX_DEFAULTS)
    # UCX and NIXL log to stdout too: only the probe's own lines
    lines = _run(probe.format(keys=keys), _clean_env(**preset))
    before, after = [line.split()[1:] for line in lines if line.startswith("ENV ")]
    assert before == [preset.get(k, "None") for k in keys]
    assert after == [preset.get(k, UCX_DEFAULTS[k]) for k in keys]
    if probe is _CONTROL_PLANE:  # ucxx's request futures on (no busy polling) unless the operator said 0
        assert f"FUTURES {preset.get('UCXPY_ENABLE_PYTHON_FUTURE') != '0'}" in lines


# ------------------------------------------------------------ docs/environment.md names every variable
_PY_READS = (
    re.compile(r"""environ(?:\.get|\.setdefault|\.pop)?\(\s*["']([A-Z][A-Z0-9_]+)["']"""),
    re.compile(r"""environ\[\s*["']([A-Z][A-Z0-9_]+)["']"""),
    re.compile(r"""getenv\(\s*["']([A-Z][A-Z0-9_]+)["']"""),
    re.compile(r"""["']([A-Z][A-Z0-9_]+)["']\s+(?:not\s+)?in\s+os\.environ"""),
    re.compile(r"""\*\*os\.environ,\s*["']([A-Z][A-Z0-9_]+)["']"""),
)
_SH_READS = re.compile(r"\$\{([A-Z][A-Z0-9_]*):[-+]")


def _variables_in_source() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for top in ("hybridkv", "connectors", "descriptors", "sims", "benchmarks", "scripts", "tests", "tools"):
        for path in (ROOT / top).rglob("*"):
            if path.suffix == ".py":
                text = path.read_text(errors="replace")
                names = {m for rx in _PY_READS for m in rx.findall(text)}
            elif path.suffix == ".sh":
                names = set(_SH_READS.findall(path.read_text(errors="replace")))
            else:
                continue
            for n in names:
                found.setdefault(n, set()).add(str(path.relative_to(ROOT)))
    for n in UCX_DEFAULTS:
        found.setdefault(n, set()).add("hybridkv/transport/env.py")
    try:  # the SGLang backend builds its variable names from its config's keys
        from dataclasses import fields

        from hybridkv.connectors.sglang.config import SGLangConfig
    except ImportError:
        pass
    else:
        for f in fields(SGLangConfig):
            found.setdefault(f"HYBRIDKV_SGLANG_{f.name.upper()}", set()).add("connectors/sglang/config.py")
    return found


def test_every_environment_variable_is_documented():
    doc = (ROOT / "docs" / "environment.md").read_text()
    documented = set(re.findall(r"^\|\s*`([A-Z][A-Z0-9_]+)`", doc, flags=re.M))
    missing = {n: sorted(paths) for n, paths in _variables_in_source().items() if n not in documented}
    assert not missing, f"docs/environment.md has no row for {missing}"
