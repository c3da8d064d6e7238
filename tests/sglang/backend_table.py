"""The table against SGLang's own NIXL backend, measured in one run on this machine (CPU, host memory).

    .venv-sglang/bin/python -m tests.sglang.backend_table [--rooms N] [--tokens T] [--chunk-tokens C]

The same requests (rooms of T tokens in chunks of C, page lists scattered in runs as a page allocator
hands them out, one chunk every --gap-ms as a forward pass would) go through (a) SGLang 0.5.23's
`NixlKVManager` and (b) hybridkv's backend, each with its real bootstrap server, managers and NIXL (UCX)
agents in separate rank processes (tests/sglang/bench_peer.py), at equal and different attention TP.
Per case: descriptors handed to NIXL per room (counted at the prefill agents' post calls), the median
time from the send of the last chunk to the decode's Success, the bytes that land, and hybridkv/SGLang.

What SGLang's NIXL backend cannot run on host memory is printed as such, with the reason from its code:
it registers state buffers as VRAM (UCX without CUDA refuses that), and refuses different attention TP
to a host-memory decode (NotImplementedError in `_prepare_payload_xfer`). For those cases its descriptor
count is computed with its own index helper (`expand_page_indices_for_slice`) for the same page lists.

A module of the test tree, not a `hybridkv bench` command: it runs on tests/sglang's rank harness
(pd_peer.py's forkserver and placeholder process groups, pools.py's model), which is not part of the
installed package. docs/benchmarks/sglang.md holds the table and how to read it.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import importlib.util
import json
import statistics
import sys
import time

import numpy as np

SUCCESS = 4  # KVPoll.Success (ints travel between processes; the plugin replaces SGLang's enums)
PREFILL_SEED = 7


class Backend(enum.Enum):
    SGLANG_NIXL = "nixl"
    HYBRIDKV = "hybridkv"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    tp_prefill: int
    tp_decode: int
    state: bool  # the GDN state slot moves with the last chunk
    staged: bool = False  # hybridkv with HYBRIDKV_SGLANG_STAGING=on (SGLang's own staging needs GPU memory)

    @property
    def name(self) -> str:
        return f"{self.tp_prefill}->{self.tp_decode}" + (" staged" if self.staged else "")

    def sglang_refusal(self) -> str | None:
        """Why SGLang's NIXL backend cannot run this case on host memory (None: it can)."""
        if self.state:
            return "state registered as VRAM (UCX without CUDA refuses it)"
        if self.tp_prefill != self.tp_decode:
            return "different TP to host memory: NotImplementedError" + (
                "; its staging buffer is GPU memory" if self.staged else "")
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    tokens: int
    chunk_tokens: int
    rooms: int
    warmup: int
    gap_s: float
    max_run: int  # longest run of consecutive pages the allocator hands out


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoomPlan:
    room: int
    src_chunks: tuple[tuple[int, ...], ...]
    dst_pages: tuple[int, ...]
    src_slot: int
    dst_slot: int
    src_aux: int
    dst_aux: int

    @property
    def src_pages(self) -> list[int]:
        return [p for c in self.src_chunks for p in c]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result:
    backend: Backend
    case: Case
    descriptors: int | None  # per room (median), all prefill ranks together
    posts: int | None
    latency_ms: float | None  # median, last chunk's send -> decode's Success
    latency_p90_ms: float | None
    bytes: int | None  # per room, landed on all decode ranks
    checked: bool  # the last room's fields equal the prefill's, field by field
    note: str = ""


def default_shape():
    from tests.sglang.bench_peer import Shape

    # Qwen3-Next-like attention: 2 KV heads of 256, page 16, 4 full-attention layers (8 K/V buffers).
    return Shape(page_size=16, num_pages=1024, kv_heads=2, head_dim=256, attn_layers=(3, 7, 11, 15))


def scattered_pages(rng: np.random.Generator, n: int, num_pages: int, max_run: int) -> list[int]:
    """n page ids as a fragmented free list hands them out: runs of 1..max_run consecutive ids, in random
    order (page 0 is SGLang's padding page)."""
    ids, runs, at = np.arange(1, num_pages + 1), [], 0
    while at < len(ids):
        k = int(rng.integers(1, max_run + 1))
        runs.append(ids[at:at + k])
        at += k
    order = rng.permutation(len(runs))
    return [int(p) for p in np.concatenate([runs[i] for i in order])[:n]]


def plan_rooms(shape, req: Request, seed: int = 0) -> list[RoomPlan]:
    from tests.sglang.pools import AUX_ROWS, MAMBA_SLOTS

    rng = np.random.default_rng(seed)
    pages = -(-req.tokens // shape.page_size)
    per_chunk = req.chunk_tokens // shape.page_size
    if per_chunk < 1 or pages > shape.num_pages:
        raise ValueError(f"{req.tokens} tokens in chunks of {req.chunk_tokens}: need 1..{shape.num_pages} pages "
                         f"and at least one page ({shape.page_size} tokens) per chunk")
    out = []
    for i in range(req.warmup + req.rooms):
        src = scattered_pages(rng, pages, shape.num_pages, req.max_run)
        dst = scattered_pages(rng, pages, shape.num_pages, req.max_run)
        out.append(RoomPlan(room=5000 + i, src_chunks=tuple(tuple(src[j:j + per_chunk])
                                                            for j in range(0, pages, per_chunk)),
                            dst_pages=tuple(dst), src_slot=1 + i % (MAMBA_SLOTS - 1),
                            dst_slot=1 + (i + 3) % (MAMBA_SLOTS - 1), src_aux=i % AUX_ROWS,
                            dst_aux=(i + 5) % AUX_ROWS))
    return out


def _setup(ranks, backend: Backend, case: Case, shape) -> str:
    from tests.sglang import pd_peer

    port = pd_peer.free_port()
    roles = [("prefill", case.tp_prefill, r) for r in range(case.tp_prefill)]
    roles += [("decode", case.tp_decode, r) for r in range(case.tp_decode)]
    for i, (role, tp, rank) in enumerate(roles):
        host = i == 0
        ranks[i].start("setup", (backend.value, role, tp, rank, port if role == "prefill" else pd_peer.free_port(),
                                 PREFILL_SEED if role == "prefill" else None, host, shape, case.state,
                                 case.staged and backend is Backend.HYBRIDKV))
        if host:
            ranks[i].result("setup")  # the bootstrap server is up before the others register
    for r in ranks[1:]:
        r.result("setup")
    return f"127.0.0.1:{port}"


def run_case(backend: Backend, case: Case, shape, req: Request, plans: list[RoomPlan]) -> Result:
    from tests.sglang.bench_peer import BenchRank

    ranks = [BenchRank() for _ in range(case.tp_prefill + case.tp_decode)]
    prefill, decode = ranks[:case.tp_prefill], ranks[case.tp_prefill:]
    try:
        addr = _setup(ranks, backend, case, shape)
        lat, descs, posts, seen = [], [], [], [0, 0]
        for n, plan in enumerate(plans):
            slot_src = plan.src_slot if case.state else None
            slot_dst = plan.dst_slot if case.state else None
            for d in decode:
                d.start("receive", (plan.room, addr, list(plan.dst_pages), plan.dst_aux, slot_dst))
            for d in decode:
                d.result("receive")
            for p in prefill:
                if (st := p.call("sender", plan.room)) != 2:  # WaitingForInput
                    raise RuntimeError(f"{backend.value} {case.name} room {plan.room}: sender at {st}")
            t0 = time.monotonic() + 0.05  # every rank has its command before the first chunk is due
            for p in prefill:
                p.start("send_timed", (plan.room, [list(c) for c in plan.src_chunks], slot_src, plan.src_aux, t0,
                                       req.gap_s))
            for d in decode:
                d.start("await_success", plan.room)
            last = max(p.result("send_timed") for p in prefill)
            done = [d.result("await_success") for d in decode]
            fin = [p.call("finish", plan.room) for p in prefill]
            bad = [x for x in done + fin if x[0] != SUCCESS]
            if bad:
                raise RuntimeError(f"{backend.value} {case.name} room {plan.room} failed: {bad}")
            total = [sum(f[2] for f in fin), sum(f[3] for f in fin)]
            if n >= req.warmup:  # the first room also pays for registration and list preparation
                lat.append(max(x[2] for x in done) - last)
                descs.append(total[0] - seen[0])
                posts.append(total[1] - seen[1])
            seen = total
        plan = plans[-1]
        checked = True
        for r, d in enumerate(decode):
            got = d.call("digests", (list(plan.dst_pages), plan.dst_slot, plan.dst_aux, case.state))
            want = _want(shape, case.tp_decode, r, plan, case.state)
            checked = checked and got == want
            if got != want:  # say which, so a wrong case can be read from its output
                bad = sorted(k for k in want if got.get(k) != want[k])
                print(f"  {backend.value} {case.name}: decode rank {r}: {len(bad)} of {len(want)} fields differ, "
                      f"first {bad[:3]}", file=sys.stderr)
        nbytes = sum(d.call("landing_bytes", (len(plan.dst_pages), case.state)) for d in decode)
        ms = sorted(x * 1e3 for x in lat)
        return Result(backend=backend, case=case, descriptors=int(statistics.median(descs)),
                      posts=int(statistics.median(posts)), latency_ms=statistics.median(ms),
                      latency_p90_ms=ms[min(len(ms) - 1, int(0.9 * len(ms)))], bytes=nbytes, checked=checked)
    finally:
        for r in ranks:
            r.close()


@functools.lru_cache(maxsize=None)
def _want(shape, tp: int, rank: int, plan: RoomPlan, state: bool) -> dict:
    """What decode rank `rank` of `tp` must hold after `plan`: its cut of the prefill's model state (drawing
    it costs seconds at the bench's size: once per decode rank, for both backends)."""
    from tests.sglang.bench_peer import digests, shaped
    from tests.sglang.pools import make_pools

    with shaped(shape):
        return digests(make_pools(PREFILL_SEED, tp=tp, rank=rank, kv_heads=shape.kv_heads), plan.src_pages,
                       plan.src_slot, plan.src_aux, state)


def sglang_computed(case: Case, shape, plans: list[RoomPlan]) -> Result:
    """SGLang's NIXL count for a case it refuses on host memory, from its own index helpers: per (prefill
    rank, decode rank) pair that exchanges KV, one slice per token of each page per K/V buffer at
    different TP (one per page per buffer at equal TP), one per state tensor x layer, one aux row."""
    from sglang.srt.disaggregation.nixl.conn import expand_page_indices_for_slice, repeat_indices_over_layers

    from tests.sglang.pools import CONV_GROUPS, GDN_LAYERS

    buffers, slots = 2 * len(shape.attn_layers), shape.num_pages + 1
    plan = plans[-1]
    pairs = max(case.tp_prefill, case.tp_decode)  # 2 KV heads: each pair exchanges one head
    kv = 0
    for c in plan.src_chunks:
        c = np.asarray(c, dtype=np.int32)
        kv += len(expand_page_indices_for_slice(c, buffers, slots, shape.page_size) if case.tp_prefill != case.tp_decode
                  else repeat_indices_over_layers(c, buffers, slots))
    # State at different TP: a conv slot is one run per q/k/v sub-block, an SSM slot one (test_hetero_plan.py).
    per_layer = (len(CONV_GROUPS) + 1) if case.tp_prefill != case.tp_decode else 2
    state = per_layer * len(GDN_LAYERS) if case.state else 0
    return Result(backend=Backend.SGLANG_NIXL, case=case, descriptors=pairs * (kv + state + 1), posts=None,
                  latency_ms=None, latency_p90_ms=None, bytes=None, checked=False,
                  note=f"not run: {case.sglang_refusal()}; descriptors from its helpers")


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def table(results: list[Result]) -> str:
    head = ("| case | moves | backend | descriptors / room | posts / room | last chunk → Success, median ms (p90) "
            "| MiB / room | hybridkv / SGLang (time; descriptors) | fields equal |")
    rows = [head, "|" + "---|" * 9]
    by = {(r.case, r.backend): r for r in results}
    for r in results:
        other = by.get((r.case, Backend.SGLANG_NIXL))
        ratio = "—"
        if r.backend is Backend.HYBRIDKV and other is not None:
            t = (f"{r.latency_ms / other.latency_ms:.2f}x" if other.latency_ms else "—")
            d = r.descriptors / other.descriptors
            ratio = f"{t}; " + (f"{d:.3f}x" if d >= 0.01 else f"1/{1 / d:,.0f}")
        moves = "KV + aux + GDN state" if r.case.state else "KV + aux"
        lat = "—" if r.latency_ms is None else f"{r.latency_ms:.1f} ({r.latency_p90_ms:.1f})"
        rows.append(f"| {r.case.name} | {moves} | {'SGLang NIXL' if r.backend is Backend.SGLANG_NIXL else 'hybridkv'}"
                    f" | {_fmt(r.descriptors, ',')} | {_fmt(r.posts, ',')} | {lat} "
                    f"| {_fmt(None if r.bytes is None else r.bytes / 2**20, '.2f')} | {ratio} "
                    f"| {'yes' if r.checked else ('—' if r.note else 'NO')} |")
    notes = [f"- {r.case.name} ({'with' if r.case.state else 'no'} state), SGLang NIXL: {r.note}"
             for r in results if r.note]
    return "\n".join(rows + ([""] + notes if notes else []))


def measure(shape, req: Request, cases: list[Case]) -> list[Result]:
    """Every case through both backends (SGLang's computed where it cannot run here), the same rooms."""
    plans = plan_rooms(shape, req)
    results = []
    started = time.monotonic()
    for case in cases:
        if case.sglang_refusal() is None:
            results.append(run_case(Backend.SGLANG_NIXL, case, shape, req, plans))
        else:
            results.append(sglang_computed(case, shape, plans))
        results.append(run_case(Backend.HYBRIDKV, case, shape, req, plans))
        print(f"  {case.name}{' +state' if case.state else ''}: done at {time.monotonic() - started:.0f} s",
              file=sys.stderr)
    return results


CASES = {
    "1->1": Case(tp_prefill=1, tp_decode=1, state=False),
    "1->1+state": Case(tp_prefill=1, tp_decode=1, state=True),
    "2->1": Case(tp_prefill=2, tp_decode=1, state=False),
    "1->2": Case(tp_prefill=1, tp_decode=2, state=False),
    "2->1-staged": Case(tp_prefill=2, tp_decode=1, state=False, staged=True),
    "1->2-staged": Case(tp_prefill=1, tp_decode=2, state=False, staged=True),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.sglang.backend_table", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rooms", type=int, default=16, help="measured rooms per case (after one warm-up room)")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens per room")
    ap.add_argument("--chunk-tokens", type=int, default=1024, help="chunked-prefill size")
    ap.add_argument("--gap-ms", type=float, default=30.0, help="time between a room's chunks (a forward pass)")
    ap.add_argument("--max-run", type=int, default=8, help="longest run of consecutive pages handed out")
    ap.add_argument("--num-pages", type=int, default=1024, help="pages in each rank's pool")
    ap.add_argument("--head-dim", type=int, default=256, help="KV head size")
    ap.add_argument("--cases", default=",".join(CASES), help=f"which of {', '.join(CASES)}")
    ap.add_argument("--json", action="store_true", help="also print the results as one JSON document")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("sglang") is None:
        print("backend_table: error: sglang is not installed in this Python; run it with the SGLang venv: "
              ".venv-sglang/bin/python -m tests.sglang.backend_table", file=sys.stderr)
        return 1
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown or args.rooms < 1:
        print(f"backend_table: error: unknown case(s) {unknown} (expected some of {list(CASES)}) or --rooms "
              f"{args.rooms} < 1", file=sys.stderr)
        return 2
    from tests.sglang import pd_peer

    shape = dataclasses.replace(default_shape(), num_pages=args.num_pages, head_dim=args.head_dim)
    req = Request(tokens=args.tokens, chunk_tokens=args.chunk_tokens, rooms=args.rooms, warmup=1,
                  gap_s=args.gap_ms / 1e3, max_run=args.max_run)
    try:
        plan_rooms(shape, req)
    except ValueError as e:
        print(f"backend_table: error: {e}", file=sys.stderr)
        return 2
    pd_peer.context()
    results = measure(shape, req, [CASES[name] for name in args.cases.split(",")])
    print(f"{req.rooms} rooms (+{req.warmup} warm-up) of {req.tokens} tokens in chunks of {req.chunk_tokens}, "
          f"page {shape.page_size}, {shape.kv_heads} KV heads x {shape.head_dim} bf16, {len(shape.attn_layers)} "
          f"attention layers; pages in runs of 1..{req.max_run}; a chunk every {args.gap_ms:g} ms")
    print(table(results))
    if args.json:
        print(json.dumps([dict(dataclasses.asdict(r), backend=r.backend.value, case=r.case.name) for r in results]))
    return 0 if all(r.checked or r.note for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
