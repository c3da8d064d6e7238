"""The built wheel is one namespace, typed, and works from a clean virtual environment (issue 45).

A wheel, not the editable install: the editable finder maps the repository folders by itself, so only
a built wheel shows what a user gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.packaging.wheel import build_wheel

pytestmark = pytest.mark.slow

# Every public package of the wheel, and the repository folder it comes from.
PACKAGES = {"hybridkv": "hybridkv", "hybridkv/descriptors": "descriptors", "hybridkv/connectors": "connectors",
            "hybridkv/sims": "sims", "hybridkv/benchmarks": "benchmarks"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def clean_venv(wheel, tmp_path_factory) -> Path:
    """A new virtual environment holding the wheel with its `cli` extra and nothing of this checkout."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # The dependencies (numpy, msgpack, rich) come from the package index, as for a user.
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"{wheel}[cli]"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return venv


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def _metadata(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        [path] = [n for n in z.namelist() if n.endswith(f".dist-info/{name}")]
        return z.read(path).decode()


def test_the_wheel_installs_exactly_one_top_level_package(wheel):
    assert _metadata(wheel, "top_level.txt").split() == ["hybridkv"]
    tops = {n.split("/")[0] for n in _names(wheel)}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"hybridkv"}


def test_every_public_package_ships_py_typed_and_the_recipes_come_along(wheel):
    names = set(_names(wheel))
    assert {f"{p}/py.typed" for p in PACKAGES} <= names
    assert "hybridkv/sims/recipes/seed-6xdep2-1xdep8.yaml" in names
    # Nothing of the repository's tooling: tests, device scripts, probes.
    assert not [n for n in names if n.startswith(("hybridkv/tests/", "hybridkv/tools/", "tests/", "tools/"))]


def test_entry_points_name_only_the_namespace(wheel):
    targets = [line.split("=", 1)[1].strip() for line in _metadata(wheel, "entry_points.txt").splitlines()
               if "=" in line]
    assert targets and all(t.startswith("hybridkv.") for t in targets), targets
    assert "hybridkv.connectors.sglang.plugin:register" in targets


def _run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    # Outside the checkout, with nothing of it on the path: only the installed wheel can answer.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_installed_wheel_runs_analyze_from_anywhere(clean_venv, tmp_path):
    proc = _run(clean_venv, str(clean_venv / "bin" / "hybridkv"), "analyze", "--model", "qwen3.5-0.8b",
                "--tokens", "4096", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {s["name"] for s in report["schemes"]} >= {"hybridkv", "vllm-0.33"}
    where = _run(clean_venv, str(clean_venv / "bin" / "python"), "-c",
                 "import hybridkv.descriptors as d; print(d.__file__)", cwd=tmp_path)
    assert str(clean_venv) in where.stdout, where.stdout + where.stderr


def test_the_old_top_level_names_are_gone(clean_venv, tmp_path):
    for old in ("descriptors", "connectors", "sims"):
        proc = _run(clean_venv, str(clean_venv / "bin" / "python"), "-c", f"import {old}", cwd=tmp_path)
        assert proc.returncode != 0 and "No module named" in proc.stderr, (old, proc.stderr)


USER_SCRIPT = '''\
from hybridkv import VirtualAllocator, get_preset, plan_layout
from hybridkv.descriptors import TransferPlan, TransferPlanner


def descriptors_for(blocks: int) -> int:
    layout = plan_layout(get_preset("qwen3.5-0.8b"), block_size=64, num_blocks=64, allocator=VirtualAllocator())
    planner = TransferPlanner(layout, layout)
    plan: TransferPlan = planner.compile({0: list(range(blocks))}, {0: list(range(blocks))})
    return plan.num_descriptors
'''


def test_mypy_reads_the_installed_planners_types(clean_venv, tmp_path):
    """PEP 561: without py.typed in hybridkv/descriptors mypy would refuse the import (or see Any)."""
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text(USER_SCRIPT)
    # The same script with a wrong annotation: mypy must see the planner's real return type to catch it.
    bad.write_text(USER_SCRIPT.replace("plan: TransferPlan =", "plan: str ="))
    mypy = [sys.executable, "-m", "mypy", "--python-executable", str(clean_venv / "bin" / "python"),
            "--no-incremental", "--cache-dir", str(tmp_path / ".mypy"), "--strict"]
    ok = _run(clean_venv, *mypy, str(good), cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    wrong = _run(clean_venv, *mypy, str(bad), cwd=tmp_path)
    assert wrong.returncode == 1 and "Incompatible types in assignment" in wrong.stdout, wrong.stdout
