"""The public API of ``hybridkv``: what importing it loads, what it exports, and ``scheduler_inputs``."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import hybridkv
from hybridkv import (
    Buffer,
    ComponentKind,
    GroupSpec,
    LayerBuffer,
    LayerKind,
    PageContent,
    VirtualAllocator,
    adopt_buffers,
    adopt_layout,
    get_preset,
    plan_layout,
    scheduler_inputs,
)

# Modules `import hybridkv` must not load: heavy or optional dependencies, and the packages above the core.
_FORBIDDEN = ("torch", "nixl", "nixl_cu12", "nixl_cu13", "ucxx", "triton", "hybridkv.descriptors", "hybridkv.connectors",
              "hybridkv.sims", "hybridkv.benchmarks")


def test_import_loads_no_optional_dependency_and_every_name_resolves():
    # A fresh interpreter: this test process has imported torch and descriptors long ago.
    code = (
        "import json, sys\n"
        "import hybridkv\n"
        "missing = [n for n in hybridkv.__all__ if not hasattr(hybridkv, n)]\n"
        f"loaded = sorted({{m for m in sys.modules if m.split('.')[0] in {list(_FORBIDDEN)!r} or '.'.join(m.split('.')[:2]) in {list(_FORBIDDEN)!r}}})\n"
        "print(json.dumps({'missing': missing, 'loaded': loaded, 'version': hybridkv.__version__}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["missing"] == []
    assert out["loaded"] == []
    assert isinstance(out["version"], str) and out["version"]


def test_all_is_unique_and_listed_in_the_docstring():
    names = hybridkv.__all__
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    # help(hybridkv) opens with the docstring: every exported name is described there.
    undocumented = [n for n in names if n != "__version__" and not re.search(rf"\b{n}\b", hybridkv.__doc__)]
    assert undocumented == []


def test_version_is_the_installed_distribution_or_a_placeholder():
    from importlib import metadata

    try:
        expected = metadata.version("hybridkv")
    except metadata.PackageNotFoundError:
        expected = "0+unknown"
    assert hybridkv.__version__ == expected


# --------------------------------------------------------------------------- scheduler_inputs


def test_planned_layout_gives_a_pool_per_group_and_gdn_two_components():
    geo = get_preset("qwen3.5-0.8b")
    layout = plan_layout(geo, block_size=64, num_blocks={LayerKind.FULL_ATTENTION: 10, LayerKind.GDN: 3},
                         allocator=VirtualAllocator())
    inputs = scheduler_inputs(layout)
    gdn = next(g.group_id for g in layout.groups if g.kind is LayerKind.GDN)
    attn = next(g.group_id for g in layout.groups if g.kind is LayerKind.FULL_ATTENTION)
    pools = inputs.pools
    assert pools.group_pools[gdn] != pools.group_pools[attn]
    assert pools.pool_sizes[pools.group_pools[gdn]] == 3
    assert pools.pool_sizes[pools.group_pools[attn]] == 10
    assert [c.kind for c in inputs.components_of(gdn)] == [ComponentKind.CONV, ComponentKind.SSM]
    assert [c.kind for c in inputs.components_of(attn)] == [ComponentKind.KV]
    assert len(inputs.components) == 3
    hybridkv.TransferScheduler(pools)  # accepted as built


def _hma_layout(*, pages: int = 8):
    """Qwen3-Next adopted as vLLM's hybrid allocator lays it out: layer i of every group on tensor i."""
    from hybridkv.descriptors.hma import plan_hma

    geo = get_preset("qwen3-next-80b-a3b")
    hma = plan_hma(geo)
    alloc = VirtualAllocator()
    tensors = [alloc.allocate(hma.page_bytes * pages) for _ in range(hma.num_tensors)]
    buffers, groups = [], []
    for grp in hma.groups:
        gdn = grp.kind is LayerKind.GDN
        groups.append(GroupSpec(group_id=grp.group_id, kind=grp.kind, layer_indices=grp.layer_indices,
                                block_tokens=None if gdn else grp.block_size))
        for i, layer in enumerate(grp.layer_indices):
            buffers.append(LayerBuffer(layer=layer, group_id=grp.group_id, addr=tensors[i].addr,
                                       block_stride=hma.page_bytes, page_bytes=hma.page_bytes, num_blocks=pages,
                                       content=PageContent.GDN if gdn else PageContent.ATTN_HND))
    return adopt_layout(geo, groups, buffers)


def test_groups_aliasing_one_tensor_share_one_pool():
    layout = _hma_layout(pages=8)
    inputs = scheduler_inputs(layout)
    # Block b of every group is page b of the same tensors: one namespace, as the fence table requires.
    assert inputs.pools.pool_sizes == (8,)
    assert inputs.pools.group_pools == (0,) * len(layout.groups)
    kinds = [c.kind for c in inputs.components]
    assert kinds.count(ComponentKind.KV) == 1 and kinds.count(ComponentKind.CONV) == 3


def test_opaque_buffers_pool_by_region_and_arrive_as_one_piece_per_group():
    kv = [Buffer(key=i, group_id=0, addr=(1 << 30) + i * (1 << 20), item_bytes=64, num_items=32) for i in range(2)]
    state = [Buffer(key=10, group_id=1, addr=1 << 32, item_bytes=48, num_items=5)]
    inputs = scheduler_inputs(adopt_buffers(kv + state))
    assert inputs.pools.pool_sizes == (32, 5) and inputs.pools.group_pools == (0, 1)
    assert [(c.group, c.kind) for c in inputs.components] == [(0, ComponentKind.KV), (1, ComponentKind.KV)]


def test_bad_layouts_are_refused_with_what_was_expected():
    with pytest.raises(ValueError, match="expected a hybridkv.layout.Layout"):
        scheduler_inputs("not a layout")  # type: ignore[arg-type]
    # Two groups on one buffer share a pool; one group over buffers of different lengths has no
    # block-id range that is valid in all of them.
    a = Buffer(key=0, group_id=0, addr=1 << 30, item_bytes=64, num_items=8)
    inputs = scheduler_inputs(adopt_buffers([a, Buffer(**{**a.__dict__, "key": 1, "group_id": 1})]))
    assert inputs.pools.pool_sizes == (8,) and inputs.pools.group_pools == (0, 0)
    uneven = adopt_buffers([a, Buffer(key=1, group_id=0, addr=1 << 31, item_bytes=64, num_items=4)])
    with pytest.raises(ValueError, match=r"page counts \{0: 4, 1: 8\}; expected one page count"):
        scheduler_inputs(uneven)
    gapped = adopt_buffers([Buffer(key=0, group_id=0, addr=1 << 30, item_bytes=64, num_items=8),
                            Buffer(key=1, group_id=2, addr=1 << 31, item_bytes=64, num_items=8)])
    with pytest.raises(ValueError, match=r"group ids \[0, 2\]; expected 0\.\.1"):
        scheduler_inputs(gapped)
    with pytest.raises(ValueError, match="group 5; expected a group index"):
        inputs.components_of(5)
