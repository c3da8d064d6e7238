"""Smoke test of the table against SGLang's NIXL backend (tests/sglang/backend_table.py), at a tiny size:
one room of each backend at equal TP, real managers and NIXL agents in rank processes. Both land every
field, and with scattered pages hybridkv posts fewer descriptors than SGLang's one per page per K/V buffer."""

from __future__ import annotations

import pytest

from tests.sglang import backend_table as bt
from tests.sglang.bench_peer import Shape

pytestmark = pytest.mark.slow


def test_both_backends_move_the_same_room_and_the_table_names_them():
    shape = Shape(page_size=4, num_pages=64, kv_heads=2, head_dim=16, attn_layers=(3, 7))
    req = bt.Request(tokens=64, chunk_tokens=32, rooms=1, warmup=1, gap_s=0.005, max_run=4)
    results = bt.measure(shape, req, [bt.CASES["1->1"]])
    theirs, ours = results
    assert (theirs.backend, ours.backend) == (bt.Backend.SGLANG_NIXL, bt.Backend.HYBRIDKV)
    assert theirs.checked and ours.checked
    assert theirs.bytes == ours.bytes == 16 * 4 * 2 * 16 * 2 * 4 + 64  # pages x tokens x heads x dim x bf16 x K/V
    assert theirs.descriptors == 16 * 4 + 1  # one per page per K/V buffer, one aux row
    assert ours.descriptors < theirs.descriptors
    assert "| 1->1 | KV + aux | hybridkv |" in bt.table(results)
