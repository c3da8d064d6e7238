"""The docs are checked: docs/lifecycle.md runs, and every citation of docs/ resolves.

The python blocks of docs/lifecycle.md run here, in order, in one namespace: a change to the API
that the page does not follow fails this test, so the page cannot drift. Code comments cite
docs/design.md and docs/background/*.md by section; a citation of a missing file or section fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import hybridkv

DOC = Path(__file__).resolve().parents[2] / "docs" / "lifecycle.md"

# A fenced block opens with ```python on its own line and closes with ``` on its own line.
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[str]:
    return [m.group(1) for m in _BLOCK.finditer(text)]


def test_the_page_has_code_to_run():
    # Guards the extraction itself: a changed fence style must not turn this into a test of nothing.
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 5, f"found {len(blocks)} python blocks in {DOC}; expected the whole walk-through"


def test_lifecycle_doc_runs():
    namespace: dict[str, object] = {"__name__": "lifecycle_doc"}
    for i, block in enumerate(python_blocks(DOC.read_text())):
        code = compile(block, f"{DOC.name}[python block {i + 1}]", "exec")
        exec(code, namespace)
    # The walk ends with the imported request computing on the decode side.
    assert namespace["decode"].phase(namespace["RID"]) is hybridkv.RequestPhase.RUNNING


# --------------------------------------------------------------------------- citations of the docs

ROOT = DOC.parents[1]
_CITED_IN = ("hybridkv", "descriptors", "connectors", "sims", "tests", "benchmarks", "scripts", "tools")
# "docs/background/vllm.md section 9", "docs/background/nixl.md §1.3", or a bare "docs/design.md".
_CITATION = re.compile(r"docs/([\w./-]+?\.md)(?:,?\s+(?:sections?\s+|§)(\d+(?:\.\d+)?))?")


def _citations():
    for folder in _CITED_IN:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in {".py", ".yaml", ".sh", ".md"} and path.is_file():
                for m in _CITATION.finditer(path.read_text(errors="replace")):
                    yield path.relative_to(ROOT), m.group(1), m.group(2)


def test_every_cited_doc_and_section_exists():
    bad = []
    for where, doc, section in _citations():
        target = ROOT / "docs" / doc
        if not target.is_file():
            bad.append(f"{where}: docs/{doc} does not exist")
        elif section is not None and not re.search(rf"^#+ {re.escape(section)}[. ]", target.read_text(), re.M):
            bad.append(f"{where}: docs/{doc} has no section {section}")
    assert bad == []


def test_no_citation_points_outside_the_repository():
    stale = re.compile(r"\bDESIGN\.md\b|\banchors/\w+\.md")
    bad = [f"{path.relative_to(ROOT)}" for folder in _CITED_IN for path in sorted((ROOT / folder).rglob("*"))
           if path.suffix in {".py", ".yaml", ".sh", ".md"} and path.is_file()
           and stale.search(path.read_text(errors="replace"))]
    assert bad == [], "cite docs/design.md or docs/background/*.md instead"
