import numpy as np
import pytest

from hybridkv.descriptors.compiler import TransferPlanner
from hybridkv.layout.alloc import NumpyAllocator, VirtualAllocator
from hybridkv.layout.fields import PageContent
from hybridkv.layout.geometry import LayerKind
from hybridkv.descriptors.hma import plan_hma
from hybridkv.layout import GroupSpec, LayerBuffer, Layout, adopt_layout, plan_layout
from hybridkv.layout.presets import get_preset


def test_gemma_hma_groups_like_vllm():
    p = plan_hma(get_preset("gemma-3-4b-it"), 64)
    assert p.group_size == 5 and p.num_tensors == 5
    assert [len(g.layer_indices) for g in p.groups] == [5, 5, 5, 5, 5, 4, 5]
    assert [g.kind for g in p.groups][-1] is LayerKind.FULL_ATTENTION
    assert p.blocks_per_group(4000) == {0: 17, 1: 17, 2: 17, 3: 17, 4: 17, 5: 17, 6: 63}


def test_qwen3_next_groups_and_aligned_block():
    p = plan_hma(get_preset("qwen3-next-80b-a3b"))
    assert [g.layer_indices[:3] for g in p.groups[:3]] == [(0, 4, 8), (1, 5, 9), (2, 6, 10)]
    assert p.groups[3].kind is LayerKind.FULL_ATTENTION and len(p.groups) == 4
    state = get_preset("qwen3-next-80b-a3b").spec_of(LayerKind.GDN).state_bytes
    per_token = 2 * 2 * 256 * 2
    assert p.block_size % 16 == 0 and p.block_size * per_token >= state > (p.block_size - 16) * per_token


def test_397b_block_size_is_raised_to_hold_a_state():
    p = plan_hma(get_preset("qwen3.5-397b-a17b"), 64)
    assert p.block_size == 2096 and p.page_bytes == 2096 * 2048


def test_block_size_must_be_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16, got 24"):
        plan_hma(get_preset("gemma-3-4b-it"), 24)


def test_planned_layout_one_span_per_block_and_fields_tile_the_page():
    g = get_preset("qwen3.5-0.8b")
    layout = plan_layout(g, block_size=64, num_blocks=4, allocator=VirtualAllocator())
    assert len(layout.regions) == 2  # one per kind
    for grp in layout.groups:
        fields = sorted(grp.placements[0].fields, key=lambda f: f.offset)
        region = layout.regions[grp.placements[0].region_id]
        end = 0
        for f in fields:
            assert f.offset >= end
            end = f.offset + f.nbytes
        assert end <= region.page_bytes


def _vllm_hma_buffers(g, hma, pages, alloc, *, block_outermost: bool):
    """Buffers shaped and aliased as vLLM 0.33 HMA does: layer i of every group on tensor i."""
    page = hma.page_bytes
    t = hma.num_tensors
    if block_outermost:  # BLHNC: one allocation, [block][tensor slot][page]
        a = alloc.allocate(page * t * pages)
        bases, stride = [a.addr + i * page for i in range(t)], page * t
        allocs = [a]
    else:  # LBHNC: one allocation per shared tensor
        allocs = [alloc.allocate(page * pages) for _ in range(t)]
        bases, stride = [a.addr for a in allocs], page
    buffers = []
    for grp in hma.groups:
        for i, layer in enumerate(grp.layer_indices):
            content = PageContent.GDN if grp.kind is LayerKind.GDN else PageContent.ATTN_HND
            buffers.append(LayerBuffer(layer=layer, group_id=grp.group_id, addr=bases[i], block_stride=stride,
                                       page_bytes=page, num_blocks=pages, content=content))
    groups = [GroupSpec(group_id=grp.group_id, kind=grp.kind, layer_indices=grp.layer_indices,
                        block_tokens=None if grp.kind is LayerKind.GDN else grp.block_size) for grp in hma.groups]
    return groups, buffers, allocs


def test_adopt_vllm_hma_dedupes_aliased_tensors():
    g = get_preset("qwen3-next-80b-a3b")
    hma = plan_hma(g)
    groups, buffers, _ = _vllm_hma_buffers(g, hma, 8, VirtualAllocator(), block_outermost=False)
    layout = adopt_layout(g, groups, buffers)
    assert len(layout.regions) == 12  # 12 shared tensors, as NixlConnector registers them
    assert all(len(grp.placements) == 12 for grp in layout.groups)


def test_adopt_vllm_block_outermost_merges_into_one_region_and_one_span_per_block():
    g = get_preset("qwen3-next-80b-a3b")
    hma = plan_hma(g)
    alloc = VirtualAllocator()
    groups, buffers, _ = _vllm_hma_buffers(g, hma, 8, alloc, block_outermost=True)
    src = adopt_layout(g, groups, buffers)
    groups, buffers, _ = _vllm_hma_buffers(g, hma, 8, alloc, block_outermost=True)
    dst = adopt_layout(g, groups, buffers)
    assert len(src.regions) == 1
    blocks = {grp.group_id: np.array([1] if grp.kind is LayerKind.GDN else [0, 2, 4]) for grp in src.groups}
    exact = TransferPlanner(src, dst).compile(blocks, blocks)
    assert exact.num_descriptors == 3 * 12 + 3  # GDN pages are padded: one run per layer state
    bridged = TransferPlanner(src, dst, bridge_padding=True).compile(blocks, blocks)
    assert bridged.num_descriptors == 3 + 3  # one per GDN group + one per attention block
    assert bridged.nbytes > exact.nbytes


def test_adopt_rejects_bad_buffers():
    g = get_preset("qwen3-next-80b-a3b")
    hma = plan_hma(g)
    groups, buffers, _ = _vllm_hma_buffers(g, hma, 8, VirtualAllocator(), block_outermost=False)
    with pytest.raises(ValueError, match="have no buffer"):
        adopt_layout(g, groups, buffers[:-1])
    small = [b if b.layer != 3 else LayerBuffer(**{**b.__dict__, "page_bytes": 100, "block_stride": 100})
             for b in buffers]
    with pytest.raises(ValueError, match="layer 3"):
        adopt_layout(g, groups, small)


def test_fingerprint_changes_with_anything_a_peer_relies_on():
    g = get_preset("qwen3.5-0.8b")
    a = plan_layout(g, block_size=64, num_blocks=4, allocator=VirtualAllocator())
    b = plan_layout(g, block_size=64, num_blocks=4, allocator=VirtualAllocator())
    assert a.fingerprint == b.fingerprint and a.shape_fingerprint == b.shape_fingerprint
    for other in (plan_layout(g, block_size=64, num_blocks=5, allocator=VirtualAllocator()),
                  plan_layout(g, block_size=32, num_blocks=4, allocator=VirtualAllocator()),
                  plan_layout(g.with_ssm_dtype(g.spec_of(LayerKind.FULL_ATTENTION).dtype), block_size=64,
                              num_blocks=4, allocator=VirtualAllocator()),
                  plan_layout(g, block_size=64, num_blocks=4, allocator=VirtualAllocator(base=1 << 41))):
        assert other.fingerprint != a.fingerprint


def test_out_of_range_block_is_refused_with_its_id():
    g = get_preset("qwen3.5-0.8b")
    src = plan_layout(g, block_size=64, num_blocks=4, allocator=NumpyAllocator())
    dst = plan_layout(g, block_size=64, num_blocks=4, allocator=NumpyAllocator())
    planner = TransferPlanner(src, dst)
    with pytest.raises(ValueError, match="dst block 7 of group 1"):
        planner.compile({0: [0], 1: [0, 1]}, {0: [0], 1: [0, 7]})
    with pytest.raises(ValueError, match="src block -1"):
        planner.compile({0: [-1], 1: [0]}, {0: [0], 1: [0]})


def test_adopt_buffers_opaque_items_coalesce_runs_on_both_sides():
    from hybridkv.layout import Buffer, adopt_buffers

    alloc = NumpyAllocator()

    def side():
        kv = [alloc.allocate(64 * 32) for _ in range(4)]  # 4 per-layer K/V buffers, 32 pages of 64 B
        state = alloc.allocate(3 * 48 * 8)                 # one tensor [3 layers][8 slots][48 B]
        bufs = [Buffer(key=i, group_id=0, addr=a.addr, item_bytes=64, num_items=32) for i, a in enumerate(kv)]
        bufs += [Buffer(key=10 + layer, group_id=1, addr=state.addr + layer * 8 * 48, item_bytes=48, num_items=8)
                 for layer in range(3)]
        layout = adopt_buffers(bufs)
        return Layout(geometry=None, tp=1, rank=0, regions=layout.regions, groups=layout.groups,
                      allocations=tuple(kv) + (state,))

    src, dst = side(), side()
    planner = TransferPlanner(src, dst)
    # pages 3,4,5 -> 10,11,12 (one run), 9 -> 20; one state slot
    plan = planner.compile({0: [3, 4, 5, 9], 1: [2]}, {0: [10, 11, 12, 20], 1: [5]})
    assert plan.num_descriptors == 4 * 2 + 3
    assert plan.nbytes == 4 * 4 * 64 + 3 * 48
    with pytest.raises(ValueError, match="src block 32 of group 0"):
        planner.compile({0: [32], 1: [0]}, {0: [0], 1: [0]})
    with pytest.raises(ValueError, match="appears twice"):
        adopt_buffers([Buffer(key=1, group_id=0, addr=4096, item_bytes=8, num_items=2)] * 2)


def test_core_imports_need_neither_torch_nor_nixl():
    import subprocess
    import sys

    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'nixl', 'nixl_cu12', 'nixl_cu13', 'ucxx', 'triton'):\n"
            "            raise ImportError('blocked ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import hybridkv.layout.geometry, hybridkv.layout, hybridkv.descriptors.hma, hybridkv.layout.presets, hybridkv.descriptors\n"
            "import hybridkv.descriptors.schemes, hybridkv.descriptors.analyze_cli\n"
            "from hybridkv.cli import main\n"
            "raise SystemExit(main(['analyze', '--model', 'qwen3.5-0.8b', '--json']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
