"""The manager is composed, not mixed: SGLang's CommonKVManager is its only base, and each of
its parts is a module that imports neither the manager nor SGLang's manager state through it."""

from __future__ import annotations

import ast
import pathlib

import hybridkv.connectors.sglang as pkg

PARTS = ("prefill_side", "decode_side", "drains", "retiring", "registrations", "peer_auth", "rooms",
         "fenced_blocks", "routes", "decode_inbox", "bootstrap")  # lanes: the core's (transport/lanes.py)


def test_manager_subclasses_only_what_sglang_calls():
    from hybridkv.connectors.sglang.conn import HybridKVManager
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    assert HybridKVManager.__bases__ == (CommonKVManager,)


def test_parts_do_not_import_the_manager():
    root = pathlib.Path(pkg.__file__).parent
    for name in PARTS:
        tree = ast.parse((root / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "hybridkv.connectors.sglang.conn" not in imported, name
