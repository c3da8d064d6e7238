"""Property tests of the descriptor compiler: for random geometries, TP pairs, block sizes and
block lists, executing the compiled descriptors with memcpy delivers exactly the requested bytes."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.descriptors.compiler import TransferPlan, TransferPlanner, plan_sources
from hybridkv.layout.alloc import NumpyAllocator
from hybridkv.layout.fields import PageContent
from hybridkv.layout.kinds.attention import attention_page_fields
from hybridkv.layout.kinds.gdn import gdn_page_fields
from hybridkv.layout.geometry import AttentionSpec, DType, GDNSpec, LayerKind, ModelGeometry
from hybridkv.layout import GroupSpec, LayerBuffer, Layout, adopt_layout, plan_layout

from .memory import execute, expected_mismatches, fill, region_array


@st.composite
def geometries(draw):
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([2, 4]))
    k_heads = draw(st.sampled_from([1, 2, 4]))
    vpk = draw(st.sampled_from([1, 2]))
    gdn = GDNSpec(num_k_heads=k_heads, num_v_heads=k_heads * vpk, head_k_dim=draw(st.sampled_from([2, 4])),
                  head_v_dim=draw(st.sampled_from([2, 4])), conv_kernel=draw(st.sampled_from([2, 3, 4])),
                  ssm_dtype=draw(st.sampled_from([DType.FLOAT32, DType.BFLOAT16])))
    full = AttentionSpec(num_kv_heads=kv_heads, head_dim=head_dim)
    sw = AttentionSpec(kind=LayerKind.SLIDING_WINDOW, num_kv_heads=kv_heads, head_dim=head_dim,
                       window=draw(st.sampled_from([16, 40])))
    kinds = draw(st.lists(st.sampled_from(["full", "sw", "gdn"]), min_size=1, max_size=5))
    layers = tuple({"full": full, "sw": sw, "gdn": gdn}[k] for k in kinds)
    return ModelGeometry(name="prop", layers=layers)


def divisors_for(g: ModelGeometry) -> list[int]:
    out = []
    for tp in (1, 2, 4):
        try:
            g.shard(tp)
        except ValueError:
            continue
        out.append(tp)
    return out


def adopted(g: ModelGeometry, *, block: int, pages: int, tp: int, rank: int) -> Layout:
    """An engine-style layout: one buffer per layer, head-outer pages (vLLM LBHNC), GDN [conv|ssm]."""
    alloc = NumpyAllocator()
    groups, buffers, allocations = [], [], []
    for gid, kind in enumerate(g.kinds()):
        layers = g.layer_indices(kind)
        groups.append(GroupSpec(group_id=gid, kind=kind, layer_indices=layers,
                                block_tokens=None if kind is LayerKind.GDN else block))
        for layer in layers:
            spec = g.layers[layer]
            if kind is LayerKind.GDN:
                fields = gdn_page_fields(spec, layer, tp=tp, rank=rank)
                content = PageContent.GDN
            else:
                fields = attention_page_fields(spec, layer, tp=tp, rank=rank, block_size=block)
                content = PageContent.ATTN_HND
            page = max(f.offset + f.nbytes for f in fields) + 8  # a little pad, as engines have
            a = alloc.allocate(page * pages)
            allocations.append(a)
            buffers.append(LayerBuffer(layer=layer, group_id=gid, addr=a.addr, block_stride=page, page_bytes=page,
                                       num_blocks=pages, content=content))
    layout = adopt_layout(g, groups, buffers, tp=tp, rank=rank)
    return Layout(geometry=layout.geometry, tp=tp, rank=rank, regions=layout.regions, groups=layout.groups,
                  allocations=tuple(allocations))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_compiled_descriptors_move_exactly_the_requested_bytes(data):
    g = data.draw(geometries())
    tps = divisors_for(g)
    tp_s, tp_d = data.draw(st.sampled_from(tps)), data.draw(st.sampled_from(tps))
    bs = data.draw(st.sampled_from([16, 32, 48]))
    bd = data.draw(st.sampled_from([16, 32, 48]))
    tokens = data.draw(st.integers(1, 150))
    src_adopted = data.draw(st.booleans())
    pages = 24
    srcs = [adopted(g, block=bs, pages=pages, tp=tp_s, rank=r) if src_adopted else
            plan_layout(g, block_size=bs, num_blocks=pages, allocator=NumpyAllocator(), tp=tp_s, rank=r)
            for r in range(tp_s)]

    def pick(n: int, label: str) -> np.ndarray:
        return np.array(data.draw(st.permutations(range(pages)), label=label)[:n], dtype=np.int64)

    sblocks: dict[int, np.ndarray] = {}
    covered: dict[int, int] = {}
    nd_of: dict[int, int] = {}
    for grp in srcs[0].groups:
        if grp.kind is LayerKind.GDN:
            ns = nd = 1
        else:
            # Both lists cover the same tokens from token 0, each rounded up to its block size
            # (the compiler refuses anything else across block sizes): a sliding window a shorter span.
            span = min(tokens, 40) if grp.kind is LayerKind.SLIDING_WINDOW else tokens
            ns, nd = math.ceil(span / bs), math.ceil(span / bd)
        sblocks[grp.group_id] = pick(ns, f"src blocks g{grp.group_id}")
        nd_of[grp.group_id] = nd
        covered[grp.group_id] = min(ns * bs, nd * bd)
    for src in srcs:
        fill(src, sblocks)

    for d in range(tp_d):
        dst = plan_layout(g, block_size=bd, num_blocks=pages, allocator=NumpyAllocator(), tp=tp_d, rank=d)
        dblocks = {gid: pick(n, f"dst blocks g{gid}") for gid, n in nd_of.items()}
        plans = []
        for s, keys in plan_sources(srcs, dst).items():
            planner = TransferPlanner(srcs[s], dst, keys=keys)
            merged = planner.compile(sblocks, dblocks)
            raw = planner.compile(sblocks, dblocks, coalesce=False)
            assert merged.nbytes == raw.nbytes
            assert merged.num_descriptors <= raw.num_descriptors
            _assert_no_overlap(merged.src)
            plans.append(merged)
            execute(merged, srcs, [dst])
        plan = TransferPlan.concat(plans)
        _assert_no_overlap(plan.dst)
        # Nothing outside the requested fields was written, and every written byte is counted once.
        written = sum(int(np.count_nonzero(region_array(dst, r.region_id))) for r in dst.regions)
        assert written == plan.nbytes
        tokens_by_group = {gid: covered[gid] for gid in covered}
        assert expected_mismatches(dst, dblocks, tokens_by_group) == []


def _assert_no_overlap(rows: np.ndarray) -> None:
    if rows.shape[0] < 2:
        return
    order = np.argsort(rows[:, 0], kind="stable")
    a = rows[order]
    assert np.all(a[1:, 0] >= a[:-1, 0] + a[:-1, 1]), "descriptors overlap"
