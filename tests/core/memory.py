"""Test helpers: fill layouts with a pattern that says what each byte is, execute plans with numpy."""

from __future__ import annotations

import zlib

import numpy as np

from hybridkv.descriptors.compiler import TransferPlan
from hybridkv.layout import Layout


def key_seed(key) -> int:
    return zlib.crc32(repr(key).encode()) & 0xFFFF


def region_array(layout: Layout, region_id: int) -> np.ndarray:
    region = layout.regions[region_id]
    for a in layout.allocations:
        if a.addr <= region.base_addr and region.base_addr + region.nbytes <= a.addr + a.nbytes:
            off = region.base_addr - a.addr
            return a.owner[off: off + region.nbytes]
    raise AssertionError(f"region {region_id} has no backing allocation")


def view(layouts: list[Layout], addr: int, n: int) -> np.ndarray:
    for layout in layouts:
        for a in layout.allocations:
            if a.addr <= addr and addr + n <= a.addr + a.nbytes:
                return a.owner[addr - a.addr: addr - a.addr + n]
    raise AssertionError(f"[{hex(addr)}, +{n}) is not inside any allocation")


def pattern(key, nbytes: int, token_bytes: int, first_token: int) -> np.ndarray:
    """What the bytes of a field are: a function of (key, global token, byte in token)."""
    j = np.arange(nbytes, dtype=np.int64)
    if token_bytes:
        t = first_token + j // token_bytes
        b = j % token_bytes
    else:
        t = np.zeros_like(j)
        b = j
    return ((key_seed(key) * 131 + t * 7919 + b * 31) % 251 + 1).astype(np.uint8)


def fill(layout: Layout, blocks: dict[int, np.ndarray]) -> None:
    """Write every field of every listed block with its pattern (block i holds tokens i*B..)."""
    for g in layout.groups:
        for i, block in enumerate(blocks.get(g.group_id, [])):
            for p in g.placements:
                arr = region_array(layout, p.region_id)
                base = int(block) * layout.regions[p.region_id].stride
                for f in p.fields:
                    first = i * (g.block_tokens or 0)
                    arr[base + f.offset: base + f.offset + f.nbytes] = pattern(f.key, f.nbytes, f.token_bytes, first)


def execute(plan: TransferPlan, src: list[Layout], dst: list[Layout]) -> None:
    for (sa, n, _), (da, n2, _) in zip(plan.src.tolist(), plan.dst.tolist()):
        assert n == n2
        view(dst, da, n)[:] = view(src, sa, n)


def expected_mismatches(dst: Layout, blocks: dict[int, np.ndarray], tokens: dict[int, int]) -> list[str]:
    """Fields of dst blocks whose bytes differ from the pattern, within the first tokens[g] tokens."""
    bad = []
    for g in dst.groups:
        for i, block in enumerate(blocks.get(g.group_id, [])):
            for p in g.placements:
                arr = region_array(dst, p.region_id)
                base = int(block) * dst.regions[p.region_id].stride
                for f in p.fields:
                    n = f.nbytes
                    if f.token_bytes:
                        valid = tokens[g.group_id] - i * g.block_tokens
                        n = max(0, min(n, valid * f.token_bytes))
                    got = arr[base + f.offset: base + f.offset + n]
                    want = pattern(f.key, f.nbytes, f.token_bytes, i * (g.block_tokens or 0))[:n]
                    if not np.array_equal(got, want):
                        bad.append(f"group {g.group_id} block {block} field {f.key}")
    return bad
