"""`hybridkv bench staging` measures what it says: the real pack of a scattered request, and the counts."""

import json

from hybridkv.cli import main


def _rows(capsys, *argv):
    assert main(["bench", "staging", "--tokens", "2048", "--iters", "1", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)["rows"]


def test_vllm_layout_packs_slices_of_every_layer_and_saves_descriptors(capsys):
    for row in _rows(capsys, "--tp", "2:1,1:2"):
        # vLLM's pages: a head slice is contiguous only inside one layer's page, so the sliced read posts
        # at least a descriptor per layer and block, and the pack is many copies (one per piece)
        assert row["sliced"] > 10 * row["staged"] >= 10, row
        assert row["copy_steps"] > 1 and row["bytes"] > 0
        assert row["gather_GBps"] > 0 and row["copy_GBps"] > 0
        assert row["auto_assumed"] in ("sliced", "direct", "slot")


def test_hybridkv_layout_slices_are_one_piece_per_page(capsys):
    (row,) = _rows(capsys, "--tp", "2:1", "--layout", "hybridkv")
    (vllm,) = _rows(capsys, "--tp", "2:1")
    assert row["sliced"] < vllm["sliced"]  # head-major pages: a slice of all layers is one piece
