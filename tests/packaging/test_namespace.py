"""From a checkout, the repository folders answer only to their installed names (issue 45): importing
``descriptors`` beside ``hybridkv.descriptors`` would give two copies of every class."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("folder", ["descriptors", "connectors", "sims", "benchmarks"])
def test_a_bare_folder_name_is_refused_naming_the_installed_one(folder):
    # The repository root first on the path, as `python` run from the checkout has it.
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); import {folder}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"ImportError: import hybridkv.{folder}, not {folder}" in proc.stderr, proc.stderr


def test_the_installed_names_resolve_to_the_repository_folders():
    import hybridkv.benchmarks
    import hybridkv.connectors
    import hybridkv.descriptors
    import hybridkv.sims

    for module, folder in ((hybridkv.descriptors, "descriptors"), (hybridkv.connectors, "connectors"),
                           (hybridkv.sims, "sims"), (hybridkv.benchmarks, "benchmarks")):
        assert Path(module.__file__).parent == ROOT / folder


def test_every_package_folder_is_listed_for_the_wheel():
    """setuptools' package-dir mapping needs an explicit package list; a folder left out of it imports
    from a checkout (the editable finder walks folders) and is missing from the wheel."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(project["packages"])
    on_disk = set()
    for name, folder in project["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join((name, *rel)))
    on_disk.add("hybridkv.sims.recipes")  # data only: its YAML files ship as package data
    assert sorted(on_disk - listed) == [] and sorted(listed - on_disk) == []
