"""Build hybridkv's wheel as a user would: from a copy of the checkout's files, not from the tree itself
(an in-tree build keeps ``build/lib`` between runs, so a deleted module would ship from it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def source_files() -> list[str]:
    """Tracked files and untracked ones git does not ignore: what a clean checkout of this tree holds."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


def build_wheel(where: Path) -> Path:
    """The wheel built from a copy of the checkout under ``where``; its path."""
    src = where / "src"
    for rel in source_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    dist = where / "dist"
    # No build isolation: the test environment's setuptools builds it, so no download is needed.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(dist), str(src)], check=True, capture_output=True, text=True)
    [wheel] = dist.glob("hybridkv-*.whl")
    return wheel
