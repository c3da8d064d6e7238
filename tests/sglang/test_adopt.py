"""SGLang's KVArgs adopted as a hybridkv Layout: groups, components, the peer's
description round trip, refusals, and the split of a compiled plan by memory
kind (KV and state in VRAM, aux rows in host memory, as on a GPU server).
No process, no NIXL: addresses come from real (CPU) tensors or are synthetic."""

from __future__ import annotations

import numpy as np
import pytest

from connectors.sglang.adopt import KV_GROUP, adopt_kv_args, from_description
from connectors.sglang.agent import registration_rows, split_by_memory
from connectors.sglang.pairing import check_pair, plan_peer
from hybridkv.layout.alloc import MemKind
from hybridkv.fencing.request_state import ComponentKind
from tests.sglang import pools as pd_peer


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
    rows = registration_rows(a.layout)[MemKind.DRAM]
    assert len(rows) <= 2 * len(pd_peer.ATTN_LAYERS) + 2 + 1
    assert int(rows[:, 1].sum()) == sum(t.nbytes for t in pools.k + pools.v + [pools.conv, pools.ssm, pools.aux])
    back = from_description(a.describe())
    assert back.layout == a.layout and back.components == a.components
    assert back.shapes == a.shapes and back.parallel == a.parallel and back.placement == a.placement
    check_pair(a, back)


def test_peer_with_other_item_sizes_at_equal_tp_is_refused_naming_the_buffer():
    args = pd_peer.make_pools(None).kv_args()
    a = adopt_kv_args(args, device_mem=MemKind.DRAM, gpu_id=0)
    args.kv_item_lens = [n // 2 for n in args.kv_item_lens]  # a TP-2 rank's pages, claiming TP 1
    b = adopt_kv_args(args, device_mem=MemKind.DRAM, gpu_id=0)
    with pytest.raises(ValueError, match="buffer 0: item of 256 bytes on the prefill, 128 on the decode at equal TP 1"):
        check_pair(a, b)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(mem=["HBM"] * len(d["mem"])), "memory kind"),
    (lambda d: d.update(key=d["key"][:-1]), "lengths"),
    (lambda d: d.update(group_id=[9] * len(d["group_id"])), "names group 9"),
    (lambda d: d.update(addr=[True] * len(d["addr"])), "non-int"),
    (lambda d: d.update(components=[[0, "bogus", [0]]]), "component kind"),
    (lambda d: d.update(shape=[["sliced", 0, 1, [], False]] * len(d["shape"])), "slicing 'sliced'"),
    (lambda d: d["parallel"].update(attn_rank=2), "attn_rank = 2; expected 0..0"),
])
def test_bad_peer_descriptions_are_refused(mutate, match):
    d = adopt_kv_args(pd_peer.make_pools(None).kv_args(), device_mem=MemKind.DRAM, gpu_id=0).describe()
    mutate(d)
    with pytest.raises(ValueError, match=match):
        from_description(d)


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
    rows = {}
    for comp, planner in plan_peer(src, dst).planners.items():
        plan = planner.compile({comp.group: blocks_s[comp.group]}, {comp.group: blocks_d[comp.group]})
        for key, (s, d) in split_by_memory(plan, src.layout, dst.layout).items():
            rows.setdefault(key, []).append((comp.kind, comp.group, s, d))
    assert set(rows) == {(MemKind.VRAM, MemKind.VRAM), (MemKind.DRAM, MemKind.DRAM)}
    assert {(k, g) for k, g, _, _ in rows[(MemKind.DRAM, MemKind.DRAM)]} == {(ComponentKind.KV, 2)}
    vram = np.concatenate([s for _, _, s, _ in rows[(MemKind.VRAM, MemKind.VRAM)]])
    assert set(vram[:, 2].tolist()) == {3}  # the GPU id travels in the dev column
    assert len(vram) == len(args.kv_data_ptrs) + len(args.state_data_ptrs[0])  # one run per buffer
