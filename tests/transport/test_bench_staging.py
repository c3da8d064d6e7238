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


def _transport_bytes(model: str, p: int, d: int, block: int, tokens: int) -> dict[int, int]:
    """Per producer rank decode rank 0 reads: the bytes the transport packs for it (the producer's stager built
    from the field mask decode rank 0's Want names), vLLM's pages; 0 where the rank feeds none of its fields."""
    import numpy as np

    from hybridkv.descriptors.hma import PageOrder, vllm_layout
    from hybridkv.descriptors.planning import DescriptorPlanner, source_ranks
    from hybridkv.layout.alloc import VirtualAllocator
    from hybridkv.layout.presets import get_preset
    from hybridkv.transport.memory import from_layout

    geo, alloc = get_preset(model), VirtualAllocator()
    n = -(-tokens // block)

    def pages(tp: int, rank: int):
        return from_layout(vllm_layout(geo, tp=tp, rank=rank, block=block, pages=2 * n + 2, allocator=alloc,
                                       order=PageOrder.BLOCK_OUTERMOST))

    ranks, _ = source_ranks(d, 0, p)
    srcs, dst = [pages(p, r) for r in ranks], pages(d, 0)
    prepared = DescriptorPlanner().prepare(srcs, dst)
    out = {}
    for i, rank in enumerate(ranks):
        consumer = prepared.stager(i)
        if consumer is None:
            out[rank] = 0
            continue
        producer = DescriptorPlanner().stager(srcs[i], dst, consumer.fields)  # what the Want's mask makes it pack
        blocks = {g.group_id: np.arange(1 if g.block_tokens is None else n) for g in dst.layout.groups}
        out[rank] = producer.nbytes(blocks)
    return out


def test_packs_per_producer_rank_what_the_transport_packs_for_the_wants_mask(capsys):
    # qwen3.5-0.8b: 2 KV heads, replicated over prefill ranks at 4:1 and 8:2; a rank whose head decode rank 0
    # reads from another packs only its GDN slices (the Want's field mask), not every field the pair shares
    rows = _rows(capsys, "--model", "qwen3.5-0.8b", "--tp", "4:1,8:2")
    for row in rows:
        p, d = (int(x) for x in row["pair"].split(":"))
        want = _transport_bytes("qwen3.5-0.8b", p, d, row["block"], 2048)
        assert {r["rank"]: r["bytes"] for r in row["ranks"]} == want, row
        assert len(set(want.values())) > 1  # the duplicate ranks pack less: the mask matters here
        timed = next(r for r in row["ranks"] if r["rank"] == row["producer_rank"])
        assert row["bytes"] == timed["bytes"] == max(want.values())  # the gather timed is the largest pack
        assert row["sliced"] == sum(r["sliced"] for r in row["ranks"])
        assert row["staged"] == sum(r["staged"] for r in row["ranks"])
