"""The staging copier's Triton row gather (hybridkv/kernels/staging) against its oracle, torch's indexing over strided
views (`gather_rows_reference`, the copier's GPU path before the kernel), byte for byte.

On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 must be set before Triton is imported, so
this file runs itself in a subprocess: `python tests/kernels/test_staging_gather.py`): random runs of several
copies each (words 1/2/4/8, aligned to 16 bytes or not, odd lengths, rows scattered, rows longer than a tile, more
than one launch per run, a row split over programs and tiles), and the copier's own plan of real packs and unpacks.
Whole buffers are compared, so a byte written outside a row shows. On a GPU (`gpu` tests) the copier runs the same
packs with the kernel and with torch. In-process CPU tests check the row table and the copier's rules: bounds before
any byte moves, and which engine runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- random runs (shared by both modes)


def random_run(rng: np.random.Generator, src, dst, *, words: tuple[int, ...], aligned: bool, steps: int,
               max_len: int = 3000) -> list:
    """``steps`` row copies from ``src`` into disjoint areas of ``dst`` (flat uint8 buffers of one kind, both
    16-byte aligned), rows scattered; every offset, stride and length a multiple of the copy's word, and of 16
    where ``aligned``, else an odd multiple of the word."""
    from hybridkv.kernels.staging.rows import RowCopy

    from hybridkv.kernels.staging.rows import address

    assert address(src) % 16 == 0 and address(dst) % 16 == 0
    out = []
    src_size, at = int(src.shape[0]), 0
    for _ in range(steps):
        word = int(rng.choice(words))
        unit = 16 if aligned else word

        def odd(k: int) -> int:  # an odd multiple of the word where unaligned: never 16-aligned
            return k if aligned else k | 1

        length = unit * odd(int(rng.integers(1, max_len // unit + 1)))
        rows = int(rng.integers(1, 9))
        src_stride = length + unit * odd(int(rng.integers(0, 20)))
        dst_stride = length + unit * int(rng.integers(0, 4))
        src_offset = unit * odd(int(rng.integers(0, 8)))
        src_pool = (src_size - src_offset - length) // src_stride + 1
        assert src_pool >= rows, "source buffer too small for the case"
        src_rows = rng.permutation(src_pool)[:rows]
        dst_pool = rows + int(rng.integers(0, 4))
        dst_offset = at + unit * odd(int(rng.integers(0, 8)))
        dst_rows = rng.permutation(dst_pool)[:rows]
        at = dst_offset + dst_stride * dst_pool
        at += -at % 16
        assert at <= int(dst.shape[0]), "destination buffer too small for the case"
        out.append(RowCopy(src=src, src_offset=src_offset, src_stride=src_stride, src_rows=src_rows, dst=dst,
                           dst_offset=dst_offset, dst_stride=dst_stride, dst_rows=dst_rows, length=length,
                           word=word))
    return out


def on(copies: list, dst) -> list:
    """The same copies into another destination buffer."""
    import dataclasses

    return [dataclasses.replace(c, dst=dst) for c in copies]


CASES = {  # name: (words, aligned, steps, max_len)
    "w1-odd": ((1,), False, 5, 3000),
    "w2-odd": ((2,), False, 5, 3000),
    "w4-odd": ((4,), False, 5, 3000),
    "w8-odd": ((8,), False, 5, 3000),
    "w8-aligned": ((8,), True, 5, 3000),
    "w1-aligned": ((1,), True, 4, 3000),
    "mixed-odd": ((1, 2, 4, 8), False, 8, 3000),   # several launches in one run
    "mixed-aligned": ((1, 2, 4, 8), True, 8, 3000),
    "long-rows": ((8, 1), True, 3, 40000),          # rows over many tiles (8 KiB each)
}


# --------------------------------------------------------------------------- the interpreter run (subprocess)


def _interpreted() -> dict:
    """Every case and the copier's packs, kernel against reference: {name: bytes that differ}."""
    import torch

    from hybridkv.kernels.staging import gather as kernel
    from hybridkv.kernels.staging.reference import gather_rows_reference
    from hybridkv.kernels.staging.rows import row_table

    out: dict = {}
    for seed, (name, (words, aligned, steps, max_len)) in enumerate(CASES.items()):
        rng = np.random.default_rng(seed)
        src = torch.from_numpy(rng.integers(0, 256, 1 << 20, dtype=np.uint8))
        before = src.clone()
        a = torch.from_numpy(rng.integers(0, 256, 1 << 20, dtype=np.uint8))
        b = a.clone()
        copies = random_run(rng, src, a, words=words, aligned=aligned, steps=steps, max_len=max_len)
        kernel.gather_rows(copies)
        gather_rows_reference(on(copies, b))
        out[name] = int((a != b).sum()) + int((src != before).sum())
        out[f"{name}/launches"] = len(row_table(copies).launches)
    # a row split over programs of several tiles each (a grid limit of 2 programs per row, so TILES > 1)
    rng = np.random.default_rng(99)
    src = torch.from_numpy(rng.integers(0, 256, 1 << 20, dtype=np.uint8))
    a = torch.zeros(1 << 20, dtype=torch.uint8)
    b = a.clone()
    copies = random_run(rng, src, a, words=(4,), aligned=True, steps=2, max_len=60000)
    limit, kernel.MAX_GRID_1 = kernel.MAX_GRID_1, 2
    try:
        out["tiles/shape"] = list(kernel.launch_shape(4, max(c.length for c in copies) // 4))
        kernel.gather_rows(copies)
    finally:
        kernel.MAX_GRID_1 = limit
    gather_rows_reference(on(copies, b))
    out["tiles"] = int((a != b).sum())
    out.update(_copier_packs(kernel.gather_rows))
    return out


def _copier_packs(gather_rows) -> dict:
    """The copier's own plan (regions, offsets, words) of real packs and unpacks, at TP 2 -> 1 and 1 -> 2 over
    hybridkv's layout and vLLM's pages: the kernel run on that plan lands what the copier's own run lands."""
    from hybridkv.descriptors.planning import DescriptorPlanner
    from hybridkv.transport.staging import Copier
    from tests.transport.hetero_peers import _counts
    from tests.transport.peers import build, build_vllm

    out = {}
    for p_tp, d_tp, kind in ((2, 1, "hybridkv"), (1, 2, "hybridkv"), (2, 1, "vllm")):
        if kind == "vllm":
            src_layout, src_memory, _ = build_vllm(10, tp=p_tp, rank=0, block=48, kernel=16, pages=16)
            dst_layout, dst_memory, _ = build_vllm(50, tp=d_tp, rank=0, block=48, kernel=16, pages=16)
        else:
            src_layout, src_memory, _ = build(10, tp=p_tp, rank=0, block=48)
            dst_layout, dst_memory, _ = build(50, tp=d_tp, rank=0, block=48)
        stager = DescriptorPlanner().stager(src_memory, dst_memory)
        theirs = {g: np.arange(1, 1 + n)[::-1].copy() for g, n in _counts(src_layout, 150).items()}
        mine = {g: np.arange(3, 3 + n) for g, n in _counts(dst_layout, 150).items()}
        nbytes = stager.nbytes(theirs)
        slots = [np.zeros(nbytes + 64, dtype=np.uint8) for _ in range(2)]
        pack = stager.pack(theirs, base=16)
        Copier(src_memory, slots[0]).run(pack)
        plan = Copier(src_memory, slots[1]).plan(pack)
        gather_rows(plan)
        out[f"pack {p_tp}:{d_tp} {kind}"] = int((slots[0] != slots[1]).sum())
        out[f"pack {p_tp}:{d_tp} {kind}/copies"] = len(plan)
        # unpack the slot into the consumer's pages: the copier's own run on a copy of them, the kernel on them
        spans = {r.region_id: np.ctypeslib.as_array(dst_layout.allocations[r.region_id].owner)
                 for r in dst_memory.regions}
        unpack = stager.unpack(theirs, mine, base=16)
        before = {i: s.copy() for i, s in spans.items()}
        Copier(dst_memory, slots[0]).run(unpack)
        expected = {i: s.copy() for i, s in spans.items()}
        for i, s in spans.items():
            s[:] = before[i]
        plan = Copier(dst_memory, slots[0]).plan(unpack)
        gather_rows(plan)
        out[f"unpack {p_tp}:{d_tp} {kind}"] = sum(int((spans[i] != expected[i]).sum()) for i in spans)
        out[f"unpack {p_tp}:{d_tp} {kind}/changed"] = sum(int((expected[i] != before[i]).sum()) for i in spans)
    return out


def test_kernel_in_the_interpreter_matches_the_reference_byte_for_byte():
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    wrong = {k: v for k, v in got.items() if "/" not in k and v != 0}
    assert not wrong, wrong  # bytes that differ from the reference, per case
    assert set(CASES) <= set(got)
    assert got["mixed-odd/launches"] > 1 and got["w8-aligned/launches"] == 1
    block, tiles, programs, _ = got["tiles/shape"]
    assert tiles > 1 and programs == 2  # the case split rows over programs of several tiles
    for k in ("pack 2:1 hybridkv", "pack 1:2 hybridkv", "pack 2:1 vllm"):
        assert got[f"{k}/copies"] >= 1 and f"un{k}" in got
    assert all(got[f"unpack {k}/changed"] > 0 for k in ("2:1 hybridkv", "1:2 hybridkv", "2:1 vllm"))


# --------------------------------------------------------------------------- in-process, CPU


def test_row_table_has_each_row_once_in_one_launch_per_word_and_alignment():
    from hybridkv.kernels.staging.rows import RowCopy, row_table

    buf = np.zeros(1 << 16, dtype=np.uint8)
    base = int(buf.ctypes.data)
    shift = -base % 16  # a 16-byte aligned start inside the buffer
    rows = np.array([3, 0, 2])

    def copy(offset: int, stride: int, length: int, word: int) -> RowCopy:
        return RowCopy(src=buf, src_offset=shift + offset, src_stride=stride, src_rows=rows, dst=buf,
                       dst_offset=shift + 8192 + offset, dst_stride=stride, dst_rows=rows[::-1].copy(),
                       length=length, word=word)

    copies = [copy(0, 512, 256, 8), copy(8, 512, 256, 8), copy(0, 1024, 512, 8), copy(1, 99, 33, 1),
              copy(16, 512, 64, 4)]
    got = row_table(copies)
    assert [(x.word, x.align, x.stop - x.start, x.max_words) for x in got.launches] == [
        (1, 1, 3, 33), (4, 16, 3, 16), (8, 8, 3, 32), (8, 16, 6, 64)]
    t = got.table
    assert t.shape == (15, 3) and t.dtype == np.int64
    # the 16-aligned word-8 class: copies 0 and 2, in order, each row's addresses and length in words
    cls = t[got.launches[3].start:got.launches[3].stop]
    assert list(cls[:3, 0] - base - shift) == [3 * 512, 0, 2 * 512]
    assert list(cls[:3, 1] - base - shift - 8192) == [2 * 512, 0, 3 * 512]
    assert list(cls[:, 2]) == [32, 32, 32, 64, 64, 64]
    with pytest.raises(ValueError, match="word 8 for 12 bytes"):
        row_table([copy(0, 512, 12, 8)])


def _row_table_per_copy(copies):
    """The row table as first written, one copy at a time (kept here as the oracle of the vectorized one)."""
    from hybridkv.kernels.staging.rows import Launch, address, alignment

    classes: dict = {}
    for c in copies:
        if c.src_rows.size and c.length:
            classes.setdefault((c.word, max(c.word, alignment(c))), []).append(c)
    parts, launches, at = [], [], 0
    for (word, align), group in sorted(classes.items()):
        start = at
        for c in group:
            part = np.empty((c.src_rows.size, 3), dtype=np.int64)
            part[:, 0] = address(c.src) + c.src_offset + c.src_rows.astype(np.int64) * c.src_stride
            part[:, 1] = address(c.dst) + c.dst_offset + c.dst_rows.astype(np.int64) * c.dst_stride
            part[:, 2] = c.length // word
            parts.append(part)
            at += c.src_rows.size
        launches.append(Launch(word=word, align=align, start=start, stop=at,
                               max_words=max(c.length for c in group) // word))
    return (np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.int64)), tuple(launches)


@pytest.mark.parametrize("seed", range(6))
def test_row_tables_built_at_once_equal_the_per_copy_build(seed):
    """row_table and the copier's table (columns of its steps, no row copy each: a kernel-block unpack has over a
    thousand steps) build, row for row and launch for launch, what a loop over the copies built; and the copier's
    word per step is the widest of 8/4/2/1 that divides every part of it."""
    import dataclasses

    from hybridkv.kernels.staging.rows import row_table
    from hybridkv.transport.staging import CopyStep, Place

    rng = np.random.default_rng(seed)
    copier, region, slot = _host_copier()
    steps = []
    for _ in range(int(rng.integers(1, 300))):
        length = int(rng.choice([1, 2, 3, 4, 8, 12, 16, 24, 32, 48]))
        src = Place(region=0, offset=int(rng.integers(0, 64)), stride=int(rng.choice([64, 128, 256])))
        dst = Place(region=None, offset=int(rng.integers(0, 64)), stride=int(rng.choice([64, 96, 128])))
        n = int(rng.integers(0, 6))
        src_pages = rng.integers(0, (4096 - src.offset - length) // src.stride + 1, n)
        dst_pages = rng.integers(0, (2048 - dst.offset - length) // dst.stride + 1, n)
        steps.append(CopyStep(src=src, dst=dst, src_pages=src_pages, dst_pages=dst_pages, length=length))
    copies = copier.plan(steps)
    for c, st in zip(copies, [s for s in steps if s.src_pages.size]):
        parts = (st.length, st.src.offset, st.src.stride, st.dst.offset, st.dst.stride, int(region.ctypes.data),
                 int(slot.ctypes.data))
        assert c.word == next(w for w in (8, 4, 2, 1) if all(p % w == 0 for p in parts))
    table, launches = _row_table_per_copy(copies)
    for got in (row_table(copies), copier.table(steps)):
        assert got.launches == launches
        assert np.array_equal(got.table, table)
    # as columns (what a stager hands over), cut in two and joined again: the same steps, table and bytes
    from hybridkv.transport.copies import CopySteps

    cut = len(steps) // 2
    cols = CopySteps.concat([CopySteps.of(steps[:cut]), steps[cut:]])
    back = cols.steps()
    assert [(a.src, a.dst, a.length) for a in back] == [(b.src, b.dst, b.length) for b in steps if b.src_pages.size]
    assert all(np.array_equal(a.src_pages, b.src_pages) and np.array_equal(a.dst_pages, b.dst_pages)
               for a, b in zip(back, [b for b in steps if b.src_pages.size]))
    assert cols.nbytes == sum(int(b.src_pages.size) * b.length for b in steps)
    got = copier.table(cols)
    assert got.launches == launches and np.array_equal(got.table, table)
    narrow = dataclasses.replace(copies[0], word=1) if copies else None
    if narrow is not None:  # a copy's own word decides its class, not its steps'
        assert row_table([narrow]).launches[0].word == 1


def _host_copier():
    from hybridkv import wire
    from hybridkv.transport.memory import MemoryMap
    from hybridkv.transport.staging import Copier

    region = np.arange(4096, dtype=np.int64).astype(np.uint8)
    info = wire.RegionInfo(region_id=0, base_addr=int(region.ctypes.data), stride=256, page_bytes=256,
                           num_pages=16, mem=wire.Mem.DRAM, device_id=0)
    slot = np.zeros(2048, dtype=np.uint8)
    return Copier(MemoryMap(regions=(info,), groups=()), slot), region, slot


def _good_and_past():
    from hybridkv.transport.staging import CopyStep, Place

    good = CopyStep(src=Place(region=0, offset=0, stride=256), dst=Place(region=None, offset=0, stride=128),
                    src_pages=np.array([1, 2]), dst_pages=np.array([0, 1]), length=128)
    past = CopyStep(src=Place(region=0, offset=0, stride=256), dst=Place(region=None, offset=0, stride=128),
                    src_pages=np.array([3]), dst_pages=np.array([16]), length=128)  # 16 * 128 + 128 > 2048
    return good, past


def test_a_step_out_of_bounds_is_refused_before_any_byte_of_the_run_moves():
    """The kernel reads and writes raw addresses: nothing but the copier's check stands between a bad step and
    memory past its span. The copier plans (and checks) every step before it runs any: a run whose last step is
    out of bounds raises and leaves the slot untouched."""
    import dataclasses

    copier, region, slot = _host_copier()
    good, past = _good_and_past()
    with pytest.raises(ValueError, match="runs past the staging slot"):
        copier.run([good, past])
    assert not slot.any()
    with pytest.raises(ValueError, match="runs past region 0"):
        copier.plan([dataclasses.replace(good, src_pages=np.array([-1, 2]))])
    copier.run([good])
    assert np.array_equal(slot[:256], np.concatenate([region[256:384], region[512:640]]))


def test_a_step_into_a_region_the_side_lacks_is_refused():
    from hybridkv.transport.staging import CopyStep, Place

    copier, _, slot = _host_copier()
    good, _ = _good_and_past()
    for region in (1, -2):
        with pytest.raises(ValueError, match=f"touches region {region}; expected one of this side's 1 regions"):
            copier.run([good, CopyStep(src=Place(region=region, offset=0, stride=256), dst=good.dst,
                                       src_pages=np.array([0]), dst_pages=np.array([3]), length=128)])
    assert not slot.any()


def test_without_the_check_a_bad_run_half_applies(monkeypatch):
    """The rule switched off: the first step's bytes land before the bad step fails (here numpy refuses a view
    past the slot; on a GPU the kernel would write past it), so the test above fails."""
    from hybridkv.transport.staging import Copier

    monkeypatch.setattr(Copier, "_check", staticmethod(lambda cols, size: None))
    copier, _, slot = _host_copier()
    with pytest.raises(ValueError, match="size of buffer"):
        copier.run(list(_good_and_past()))
    assert slot.any()


def test_engine_from_the_environment_and_config(monkeypatch):
    from hybridkv.transport.staging import GATHER_ENV, GatherEngine, StagingConfig

    monkeypatch.delenv(GATHER_ENV, raising=False)
    assert StagingConfig().gather is GatherEngine.AUTO
    monkeypatch.setenv(GATHER_ENV, "torch")
    assert StagingConfig().gather is GatherEngine.TORCH
    monkeypatch.setenv(GATHER_ENV, "cuda")
    with pytest.raises(ValueError, match="HYBRIDKV_STAGING_GATHER='cuda'; expected one of auto, triton, torch"):
        StagingConfig()
    with pytest.raises(ValueError, match="staging gather 'torch'; expected a GatherEngine"):
        StagingConfig(gather="torch")


def test_the_copier_picks_the_kernel_where_triton_imports_and_torch_where_told(monkeypatch):
    """Which function runs a GPU copier's gathers (resolved without a GPU). Triton missing is a fault this
    machine cannot cause (it is installed): the kernel module is made unimportable (a fake, named so)."""
    pytest.importorskip("triton")
    from hybridkv.kernels.staging.reference import gather_rows_reference
    from hybridkv.transport.staging import Copier, GatherEngine

    copier, _, slot = _host_copier()
    memory = copier._memory

    def engine(e):
        return Copier(memory, slot, engine=e).gpu_gather()

    assert engine(GatherEngine.AUTO).__name__ == "gather_rows"
    assert engine(GatherEngine.TRITON).__module__ == "hybridkv.kernels.staging.gather"
    assert engine(GatherEngine.TORCH) is gather_rows_reference
    monkeypatch.setitem(sys.modules, "hybridkv.kernels.staging.gather", None)  # fake: Triton not importable
    assert engine(GatherEngine.AUTO) is gather_rows_reference
    with pytest.raises(RuntimeError, match="engine 'triton', but the Triton kernel does not import"):
        engine(GatherEngine.TRITON)


def test_importing_the_staging_transport_imports_neither_torch_nor_triton():
    code = ("import sys, hybridkv.transport.staging, hybridkv.kernels.staging as k; k.RowCopy; "
            "print([m for m in ('torch', 'triton') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_on_the_gpu_matches_the_reference(name):
    import torch

    from hybridkv.kernels.staging.gather import gather_rows
    from hybridkv.kernels.staging.reference import gather_rows_reference

    words, aligned, steps, max_len = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name))
    src = torch.from_numpy(rng.integers(0, 256, 1 << 20, dtype=np.uint8)).cuda()
    a = torch.from_numpy(rng.integers(0, 256, 1 << 20, dtype=np.uint8)).cuda()
    b = a.clone()
    copies = random_run(rng, src, a, words=words, aligned=aligned, steps=steps, max_len=max_len)
    gather_rows(copies)
    gather_rows_reference(on(copies, b))
    torch.cuda.synchronize()
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (4, 1)])
def test_copier_packs_on_the_gpu_with_the_kernel_as_with_torch(p_tp, d_tp):
    import torch

    from hybridkv.descriptors.planning import DescriptorPlanner
    from hybridkv.transport.staging import Copier, GatherEngine
    from tests.transport.hetero_peers import _counts
    from tests.transport.peers import build

    # the test geometry has 2 KV heads: a TP above that needs as many heads as ranks (as hetero_peers does)
    heads = max(p_tp, d_tp)
    geo = {"num_kv_heads": heads, "num_k_heads": heads, "num_v_heads": heads} if heads > 2 else None
    src_layout, src_memory, _ = build(10, tp=p_tp, rank=0, block=48, mem="vram", geo_over=geo)
    _, dst_memory, _ = build(50, tp=d_tp, rank=0, block=48, mem="vram", geo_over=geo)
    stager = DescriptorPlanner().stager(src_memory, dst_memory)
    theirs = {g: np.arange(1, 1 + n)[::-1].copy() for g, n in _counts(src_layout, 300).items()}
    pack = stager.pack(theirs, base=16)
    slots = [torch.zeros(stager.nbytes(theirs) + 64, dtype=torch.uint8, device="cuda:0") for _ in range(2)]
    kernel = Copier(src_memory, slots[0], engine=GatherEngine.TRITON)
    assert kernel.gpu_gather().__module__ == "hybridkv.kernels.staging.gather"
    kernel.run(pack)
    Copier(src_memory, slots[1], engine=GatherEngine.TORCH).run(pack)
    assert torch.equal(slots[0], slots[1]) and bool(slots[0][16:].any())


if __name__ == "__main__":
    # run by test_kernel_in_the_interpreter_matches_the_reference_byte_for_byte with TRITON_INTERPRET=1
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1 (the kernel runs in Triton's CPU interpreter)")
    print(json.dumps(_interpreted()))
