"""The planner's rules: how block lists of unequal length pair, which pairing is chosen, and
that a page plan's index form merges exactly as NIXL's make_prepped_xfer does."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.descriptors.compiler import TransferPlanner
from hybridkv.descriptors.planning import DescriptorPlanner, FieldPlan, PagePlan, pairing_of
from hybridkv.layout import plan_layout
from hybridkv.layout.alloc import NumpyAllocator
from hybridkv.layout.geometry import LayerKind
from hybridkv.transport.config import Pairing
from hybridkv.transport.memory import MemoryMap, from_layout
from tests.transport.peers import geometry

PAGES = 24


def _layout(*, block=16, tp=1, rank=0):
    return plan_layout(geometry(), block_size=block, num_blocks=PAGES, allocator=NumpyAllocator(), tp=tp, rank=rank)


def _gids(layout):
    attn = next(g.group_id for g in layout.groups if g.kind is LayerKind.FULL_ATTENTION)
    gdn = next(g.group_id for g in layout.groups if g.kind is LayerKind.GDN)
    return attn, gdn


def _same(a, b) -> bool:
    return all(np.array_equal(getattr(a, n), getattr(b, n)) for n in ("src", "dst", "src_region", "dst_region"))


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 1), (1, 2)])  # affine fast path, field-matched general path
def test_a_shorter_dst_list_pairs_with_the_src_tail(src_tp, dst_tp):
    src, dst = _layout(tp=src_tp), _layout(tp=dst_tp)
    attn, gdn = _gids(dst)
    planner = TransferPlanner(src, dst)
    sb = {attn: np.array([4, 5, 6, 9, 10]), gdn: np.array([2])}
    db = {attn: np.array([11, 12]), gdn: np.array([7])}  # a prefix hit: the decode side holds 3 blocks
    got = planner.compile(sb, db)
    want = planner.compile({attn: sb[attn][3:], gdn: sb[gdn]}, db)
    assert _same(got, want) and got.nbytes == want.nbytes > 0


def test_longer_dst_and_unequal_state_lists_are_refused_naming_group_and_lengths():
    src, dst = _layout(), _layout()
    attn, gdn = _gids(dst)
    planner = TransferPlanner(src, dst)
    with pytest.raises(ValueError, match=rf"group {attn}: dst lists 3 blocks but src only 2"):
        planner.compile({attn: [0, 1], gdn: [0]}, {attn: [0, 1, 2], gdn: [0]})
    with pytest.raises(ValueError, match=rf"group {gdn} holds state.*src has 1 blocks, dst 2"):
        planner.compile({attn: [0, 1], gdn: [0]}, {attn: [0, 1], gdn: [0, 1]})


def test_different_block_sizes_pair_from_token_zero_and_refuse_inconsistent_lengths():
    src, dst = _layout(block=16), _layout(block=48)
    attn, gdn = _gids(dst)
    planner = TransferPlanner(src, dst)
    # 100 tokens: 7 blocks of 16, 3 of 48
    plan = planner.compile({attn: np.arange(7), gdn: [0]}, {attn: np.arange(3), gdn: [0]})
    assert plan.num_descriptors > 0
    with pytest.raises(ValueError, match=rf"group {attn}: src lists 3 blocks of 16 tokens, dst 3 blocks of 48"):
        planner.compile({attn: np.arange(3), gdn: [0]}, {attn: np.arange(3), gdn: [0]})
    with pytest.raises(ValueError, match=rf"group {attn}: src lists 9 blocks of 16 tokens, dst 2 blocks of 48"):
        planner.compile({attn: np.arange(9), gdn: [0]}, {attn: np.arange(2), gdn: [0]})
    # A dst that wants nothing reads nothing of that group.
    assert planner.compile({attn: np.arange(7), gdn: [0]}, {attn: np.arange(0), gdn: [0]}).num_descriptors > 0


def test_pairing_is_decided_by_page_shapes_and_fields():
    a = from_layout(_layout())
    assert pairing_of([a], from_layout(_layout())) is Pairing.PAGES
    assert pairing_of([a], from_layout(_layout(block=48))) is Pairing.FIELDS
    assert pairing_of([a, from_layout(_layout())], from_layout(_layout())) is Pairing.FIELDS
    # TP 2 ranks 0 and 1: the same page bytes, other heads in them.
    r0, r1 = from_layout(_layout(tp=2, rank=0)), from_layout(_layout(tp=2, rank=1))
    assert pairing_of([r1], r0) is Pairing.FIELDS and pairing_of([r0], from_layout(_layout(tp=2))) is Pairing.PAGES
    assert isinstance(DescriptorPlanner().prepare([a], from_layout(_layout())), PagePlan)
    assert isinstance(DescriptorPlanner().prepare([a], from_layout(_layout(block=48))), FieldPlan)
    with pytest.raises(ValueError, match="pairing=FIELDS"):
        DescriptorPlanner(pairing=Pairing.PAGES).prepare([a], from_layout(_layout(block=48)))


def _nixl_count(plan, src: MemoryMap, dst: MemoryMap) -> int:
    """What make_prepped_xfer posts for the plan's index pairs, in their order: a pair extends the
    previous descriptor when both indices follow it in one region whose pages are back to back."""
    def region_of(m: MemoryMap, idx):
        return np.searchsorted(m.offsets, idx, side="right") - 1

    si, di = plan.src_index.astype(np.int64), plan.dst_index.astype(np.int64)
    rs, rd = region_of(src, si), region_of(dst, di)
    dense_s = np.array([r.stride == r.page_bytes for r in src.regions])[rs]
    dense_d = np.array([r.stride == r.page_bytes for r in dst.regions])[rd]
    step = ((np.diff(si) == 1) & (np.diff(di) == 1) & (rs[1:] == rs[:-1]) & (rd[1:] == rd[:-1])
            & dense_s[:-1] & dense_d[:-1])
    return int(si.size - step.sum()) if si.size else 0


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_page_plan_indices_merge_as_nixl_does(data):
    src, dst = from_layout(_layout()), from_layout(_layout())
    attn, gdn = _gids(src.layout)
    n = data.draw(st.integers(0, 12))
    hit = data.draw(st.integers(0, n))
    sb = np.array(data.draw(st.permutations(range(PAGES)))[:n], dtype=np.int64)
    db = np.array(data.draw(st.permutations(range(PAGES)))[: n - hit], dtype=np.int64)
    plan = DescriptorPlanner().prepare([src], dst).plan(0, {attn: sb, gdn: np.array([3])},
                                                      {attn: db, gdn: np.array([5])})
    plan.check()
    assert plan.indexed and plan.num_indices == n - hit + 1
    assert plan.num_descriptors == _nixl_count(plan, src, dst)
    # Every page pair once: the index pairs are the tail-aligned block pairs, in dst-index order.
    off_s, off_d = src.offsets, dst.offsets
    ra, rg = src.group(attn).region_ids[0], src.group(gdn).region_ids[0]
    want = {(int(off_s[ra] + s), int(off_d[ra] + d)) for s, d in zip(sb[hit:], db)} | {
        (int(off_s[rg] + 3), int(off_d[rg] + 5))}
    assert set(zip(plan.src_index.tolist(), plan.dst_index.tolist())) == want
    assert np.all(np.diff(plan.dst_index) > 0)


def _engine_layout(g, *, reverse: bool):
    """An engine-style layout, one buffer per layer inside one allocation: the buffers in layer
    order, or reversed (engines number regions by address, so the same group lists its layers
    in another order)."""
    from hybridkv.layout import GroupSpec, LayerBuffer, Layout, adopt_layout
    from hybridkv.layout.fields import PageContent
    from hybridkv.layout.kinds.attention import attention_page_fields
    from hybridkv.layout.kinds.gdn import gdn_page_fields

    groups, pages = [], []
    for gid, kind in enumerate(g.kinds()):
        groups.append(GroupSpec(group_id=gid, kind=kind, layer_indices=g.layer_indices(kind),
                                block_tokens=None if kind is LayerKind.GDN else 16))
        for layer in g.layer_indices(kind):
            spec = g.layers[layer]
            fields = (gdn_page_fields(spec, layer, tp=1, rank=0) if kind is LayerKind.GDN
                      else attention_page_fields(spec, layer, tp=1, rank=0, block_size=16))
            content = PageContent.GDN if kind is LayerKind.GDN else PageContent.ATTN_HND
            pages.append((gid, layer, max(f.offset + f.nbytes for f in fields), content))
    whole = NumpyAllocator().allocate(sum(p[2] for p in pages) * PAGES)
    buffers, addr = [], whole.addr
    for gid, layer, page, content in (reversed(pages) if reverse else pages):
        buffers.append(LayerBuffer(layer=layer, group_id=gid, addr=addr, block_stride=page, page_bytes=page,
                                   num_blocks=PAGES, content=content))
        addr += page * PAGES
    layout = adopt_layout(g, groups, buffers, tp=1, rank=0)
    return Layout(geometry=layout.geometry, tp=1, rank=0, regions=layout.regions, groups=layout.groups,
                  allocations=(whole,))


@pytest.mark.parametrize("reverse", [False, True], ids=["same-order", "regions-in-another-order"])
def test_page_plan_of_groups_spread_over_regions(reverse):
    """Every GDN layer in its own region: the compiler's general path makes the index pairs, one per
    page, merged as NIXL does; regions pair by the fields they hold, not by their numbers."""
    from tests.core.memory import execute, expected_mismatches, fill

    g = geometry()
    src_l, dst_l = _engine_layout(g, reverse=False), _engine_layout(g, reverse=reverse)
    src, dst = from_layout(src_l), from_layout(dst_l)
    assert pairing_of([src], dst) is Pairing.PAGES
    attn, gdn = _gids(src_l)
    n_gdn = len(src.group(gdn).region_ids)
    assert n_gdn > 1
    sb, db = {attn: np.array([2, 3, 4, 9]), gdn: np.array([1])}, {attn: np.array([7, 8, 9, 0]), gdn: np.array([4])}
    plan = DescriptorPlanner().prepare([src], dst).plan(0, sb, db)
    plan.check()
    assert plan.num_indices == 4 + n_gdn
    assert plan.num_descriptors == _nixl_count(plan, src, dst) == 2 + n_gdn
    fill(src_l, sb)
    execute(plan, [src_l], [dst_l])
    assert expected_mismatches(dst_l, db, {attn: 4 * 16, gdn: 0}) == []
