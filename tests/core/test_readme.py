"""The README is checked: its library quick start runs, it stays a front page, and what it names exists.

The python block of README.md runs here, as it is written, so a change to the API that the quick start does
not follow fails this test. Every repository path the README names in backquotes must exist, and no install line
in the README or the operator pages installs hybridkv from the public package index (there is no such
distribution there: a checkout or a built wheel).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from tests.core.test_lifecycle_doc import python_blocks

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# The pages the README sends operators to for installing and deploying.
OPERATOR_PAGES = ("README.md", "docs/deploy-vllm.md", "docs/deploy-sglang.md", "docs/security.md",
                  "docs/simulators.md", "docs/demo.md", "docs/benchmarks/transfer.md")


def test_the_quick_start_runs():
    blocks = python_blocks(README.read_text())
    assert len(blocks) == 1, f"found {len(blocks)} python blocks in README.md; expected the library quick start"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], "README.md[quick start]", "exec"), {"__name__": "readme"})
    lines = out.getvalue().splitlines()
    # What the comments beside the prints say they print.
    assert lines[0] == "2 descriptors, 305 MiB", lines
    assert lines[1].startswith("NotYet(reason=<NotYetReason.PENDING_STEP"), lines


def test_the_readme_is_a_front_page():
    n = len(README.read_text().splitlines())
    assert n <= 300, f"README.md has {n} lines; detail belongs in docs/"


_PATH = re.compile(r"`((?:docs|tests|scripts|tools|benchmarks|connectors|descriptors|sims|hybridkv|\.ci)/[\w./-]*)`")


def test_every_path_the_readme_names_exists():
    missing = sorted({p for p in _PATH.findall(README.read_text()) if not (ROOT / p.rstrip("/")).exists()})
    assert missing == []


_FROM_THE_INDEX = re.compile(r"pip install\s+['\"]?hybridkv\b")


def test_no_install_line_asks_the_package_index_for_hybridkv():
    bad = [f"{page}:{i}: {line.strip()}" for page in OPERATOR_PAGES
           for i, line in enumerate((ROOT / page).read_text().splitlines(), 1) if _FROM_THE_INDEX.search(line)]
    assert bad == [], "install from a checkout (pip install -e '.[transport]') or a built wheel (dist/...whl)"
