"""SGLang's KVArgs adopted as a hybridkv Layout: groups, components, the peer's
view through the backend's registration message (hybridkv's wire codecs) and
refusals, and the data plane's split of a compiled plan by memory kind (KV and
state in VRAM, aux rows in host memory, as on a GPU server). No process, no
NIXL: addresses come from real (CPU) tensors or are synthetic."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from hybridkv.connectors.sglang import messages as msgs
from hybridkv.connectors.sglang.adopt import KV_GROUP, AdoptedLayout, adopt_kv_args, from_peer
from hybridkv.connectors.sglang.pairing import check_pair, plan_peer
from hybridkv.descriptors.compiler import TransferPlan
from hybridkv import wire
from hybridkv.layout.alloc import MemKind
from hybridkv.fencing.request_state import ComponentKind
from hybridkv.transport.dataplane import MemorySpans, group_by_kind
from tests.sglang import pools as pd_peer


def _register(a: AdoptedLayout, view: msgs.PeerLayout | None = None) -> list[bytes]:
    return msgs.Register(endpoint="127.0.0.1", port=5000, agent_name="decode-agent", agent_metadata=b"nixl",
                         layout=view or a.peer_view(), attn_tp_size=1, attn_tp_rank=0, state_types=("MAMBA",),
                         fingerprint="f").to_frames()


def _through_wire(a: AdoptedLayout, view: msgs.PeerLayout | None = None) -> AdoptedLayout:
    """`a` as the prefill rebuilds it from the decode's registration."""
    reg = msgs.decode(_register(a, view))
    assert isinstance(reg, msgs.Register) and reg.agent_name == "decode-agent"
    return from_peer(reg.layout)


def _adopted() -> AdoptedLayout:
    return adopt_kv_args(pd_peer.make_pools(None).kv_args(), device_mem=MemKind.DRAM, gpu_id=0)


def test_groups_components_and_registrations_of_a_hybrid_model():
    pools = pd_peer.make_pools(None)
    a = adopt_kv_args(pools.kv_args(), device_mem=MemKind.DRAM, gpu_id=0)
    n_gdn = len(pd_peer.GDN_LAYERS)
    assert (a.num_state_groups, a.aux_group) == (1, 2)
    comps = {(c.group, c.kind): keys for c, keys in a.components}
    assert len(comps[(0, ComponentKind.KV)]) == 2 * len(pd_peer.ATTN_LAYERS)
    # MambaPool lists conv layers first, then SSM: tensor 0 is conv.
    assert len(comps[(1, ComponentKind.CONV)]) == len(comps[(1, ComponentKind.SSM)]) == n_gdn
    assert max(comps[(1, ComponentKind.CONV)]) < min(comps[(1, ComponentKind.SSM)])
    assert len(comps[(2, ComponentKind.KV)]) == 1
    assert a.group_blocks == (pd_peer.NUM_PAGES + 1, pd_peer.MAMBA_SLOTS + 1, pd_peer.AUX_ROWS)
    # The per-layer slices of one state tensor touch: one registration each, not one per layer.
    spans = MemorySpans.of(a.memory.regions)
    assert spans.single is wire.Mem.DRAM
    rows = spans.rows[wire.Mem.DRAM]
    assert len(rows) <= 2 * len(pd_peer.ATTN_LAYERS) + 2 + 1
    assert int(rows[:, 1].sum()) == sum(t.nbytes for t in pools.k + pools.v + [pools.conv, pools.ssm, pools.aux])
    back = _through_wire(a)
    assert back.layout == a.layout and back.components == a.components and back.buffers == a.buffers
    assert back.shapes == a.shapes and back.parallel == a.parallel and back.placement == a.placement
    check_pair(a, back)


def test_peer_with_other_item_sizes_at_equal_tp_is_refused_naming_the_buffer():
    args = pd_peer.make_pools(None).kv_args()
    a = adopt_kv_args(args, device_mem=MemKind.DRAM, gpu_id=0)
    args.kv_item_lens = [n // 2 for n in args.kv_item_lens]  # a TP-2 rank's pages, claiming TP 1
    b = adopt_kv_args(args, device_mem=MemKind.DRAM, gpu_id=0)
    with pytest.raises(ValueError, match="buffer 0: item of 256 bytes on the prefill, 128 on the decode at equal TP 1"):
        check_pair(a, b)


# The registration's layout on the wire: [regions, groups, table, state_groups, shapes, components, parallel].
@pytest.mark.parametrize("mutate, match", [
    (lambda lay: lay[0][0].__setitem__(5, 9), r"layout.regions\[0\].mem = 9; expected one of \[1, 2\]"),
    (lambda lay: lay.__setitem__(3, True), "state_groups is bool; expected an int"),
    (lambda lay: lay[5][0][0].__setitem__(1, "bogus"), r"kind = 'bogus'; expected one of \['kv', 'conv', 'ssm'"),
    (lambda lay: lay[4][0][1].__setitem__(0, "sliced"), "slicing = 'sliced'"),
    (lambda lay: lay[4].append(lay[4][0]), "lists key 0 twice"),
    (lambda lay: lay[6].__setitem__(1, 2), "attn_rank = 2; expected 0..0"),
])
def test_bad_peer_layouts_are_refused_by_the_wire(mutate, match):
    tag, body = _register(_adopted())
    top = msgpack.unpackb(body)
    mutate(top[2][4])
    with pytest.raises(ValueError, match=match):
        msgs.decode([tag, msgpack.packb(top)])


def test_an_older_peer_is_refused_naming_the_versions():
    tag, body = _register(_adopted())
    top = msgpack.unpackb(body)
    top[0] = msgs.VERSION - 1
    with pytest.raises(wire.WireError, match=f"version {msgs.VERSION - 1}; this side speaks {msgs.VERSION}"):
        msgs.decode([tag, msgpack.packb(top)])


@pytest.mark.parametrize("change, match", [
    (dict(num_state_groups=0), "is in group 2; expected 0..1"),
    (lambda v: dict(shapes=v.shapes[:-1]), "one shape per buffer"),
])
def test_views_that_do_not_fit_together_are_refused(change, match):
    a = _adopted()
    view = a.peer_view()
    view = dataclasses.replace(view, **(change(view) if callable(change) else change))
    with pytest.raises(ValueError, match=match):
        _through_wire(a, view)


def test_peer_regions_that_its_buffers_do_not_make_are_refused():
    a = _adopted()
    view = a.peer_view()
    r0 = view.regions[0]
    spaced = dataclasses.replace(r0, stride=r0.stride + 8)
    with pytest.raises(ValueError, match=f"items of {r0.page_bytes} bytes every {r0.stride + 8} bytes; expected packed"):
        _through_wire(a, dataclasses.replace(view, regions=(spaced, *view.regions[1:])))
    spare = dataclasses.replace(r0, region_id=len(view.regions))  # a region no buffer makes
    with pytest.raises(ValueError, match="not those its buffers make"):
        _through_wire(a, dataclasses.replace(view, regions=(*view.regions, spare)))


def test_plan_rows_split_vram_kv_and_state_from_host_aux():
    args = pd_peer.make_pools(None).kv_args()  # sizes only; the addresses below are synthetic device ones

    def shifted(base):
        import copy

        a = copy.copy(args)
        a.kv_data_ptrs = [base + i * (1 << 24) for i in range(len(args.kv_data_ptrs))]
        a.state_data_ptrs = [[base + (1 << 30) + i * (1 << 20) for i in range(len(args.state_data_ptrs[0]))]]
        return adopt_kv_args(a, device_mem=MemKind.VRAM, gpu_id=3)

    src, dst = shifted(1 << 40), shifted(1 << 41)
    blocks_s = {KV_GROUP: np.array([4, 5, 6]), src.state_group(0): np.array([1]), src.aux_group: np.array([2])}
    blocks_d = {KV_GROUP: np.array([7, 8, 9]), src.state_group(0): np.array([3]), src.aux_group: np.array([5])}
    plans = [planner.compile({c.group: blocks_s[c.group]}, {c.group: blocks_d[c.group]})
             for c, planner in plan_peer(src, dst).planners.items()]
    plan = TransferPlan.concat(plans)
    s_spans, d_spans = MemorySpans.of(src.memory.regions), MemorySpans.of(dst.memory.regions)
    assert s_spans.single is None and set(s_spans.rows) == {wire.Mem.VRAM, wire.Mem.DRAM}
    rows = group_by_kind(plan.src.astype(np.uint64), s_spans, plan.dst.astype(np.uint64), d_spans)
    assert set(rows) == {(wire.Mem.VRAM, wire.Mem.VRAM), (wire.Mem.DRAM, wire.Mem.DRAM)}
    aux = rows[(wire.Mem.DRAM, wire.Mem.DRAM)][0]
    assert len(aux) == 1 and int(aux[0, 0]) == args.aux_data_ptrs[0] + 2 * args.aux_item_lens[0]
    vram = rows[(wire.Mem.VRAM, wire.Mem.VRAM)][0]
    assert set(vram[:, 2].tolist()) == {3}  # the GPU id travels in the dev column
    assert len(vram) == len(args.kv_data_ptrs) + len(args.state_data_ptrs[0])  # one run per buffer
    outside = plan.src.astype(np.uint64).copy()
    outside[0, 0] = 4096
    with pytest.raises(ValueError, match="local row 0 .* lies in no registered region"):
        group_by_kind(outside, s_spans, plan.dst.astype(np.uint64), d_spans)
