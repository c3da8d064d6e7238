"""One rank of the backend table (tests/sglang/backend_table.py): SGLang's own NIXL backend
(`NixlKVManager`, 0.5.23) or hybridkv's, built the same way in a rank process forked from
pd_peer's forkserver, over pools of the bench's shape (pools.py's layout, larger).

Both backends get the same KVArgs (KV in host memory: `kv_data_mem_kinds` DRAM for SGLang's),
the same page lists and the same chunk schedule. Each rank follows one clock: chunk i of a room
is sent at `t0 + i * gap` (CLOCK_MONOTONIC is one clock for every process of the machine), so the
driver's round trips do not enter the time from the last chunk's send to the decode's Success.

Descriptors are counted where both backends hand them to NIXL: the prefill agent's
`make_prepped_xfer` (index-list lengths) and `initialize_xfer` (descriptor-list lengths).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import numpy as np

from tests.sglang import pd_peer, pools


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    """The bench model's memory: pools.py's layout with these sizes (set in the rank process only)."""

    page_size: int
    num_pages: int
    kv_heads: int
    head_dim: int
    attn_layers: tuple[int, ...]


_SHAPED = ((pools, "PAGE_SIZE"), (pools, "NUM_PAGES"), (pools, "HEAD_DIM"), (pools, "ATTN_LAYERS"),
           (pd_peer, "PAGE_SIZE"))


def use_shape(shape: Shape) -> None:
    """pools.py's model at this shape in this process (it reads its module constants at call time): for
    good in a bench rank process, which is its own copy; elsewhere through `shaped`."""
    values = (shape.page_size, shape.num_pages, shape.head_dim, shape.attn_layers, shape.page_size)
    for (module, name), value in zip(_SHAPED, values):
        setattr(module, name, value)


@contextlib.contextmanager
def shaped(shape: Shape):
    """pools.py's model at this shape while inside, as it was after (the driver, or a pytest process)."""
    saved = [getattr(module, name) for module, name in _SHAPED]
    use_shape(shape)
    try:
        yield
    finally:
        for (module, name), value in zip(_SHAPED, saved):
            setattr(module, name, value)


class _Counting:
    """Wraps a NIXL agent's two post calls on the instance; counts descriptors and posts."""

    def __init__(self, agent) -> None:
        self.descriptors = self.posts = 0
        prepped, initialize = agent.make_prepped_xfer, agent.initialize_xfer

        def make_prepped_xfer(op, local, local_idx, remote, remote_idx, *a, **k):
            self.descriptors += len(local_idx)
            self.posts += 1
            return prepped(op, local, local_idx, remote, remote_idx, *a, **k)

        def initialize_xfer(op, local_descs, remote_descs, *a, **k):
            self.descriptors += local_descs.descCount() if hasattr(local_descs, "descCount") else len(local_descs)
            self.posts += 1
            return initialize(op, local_descs, remote_descs, *a, **k)

        agent.make_prepped_xfer, agent.initialize_xfer = make_prepped_xfer, initialize_xfer


def _nixl_under_its_own_name() -> None:
    """SGLang's NIXL backend imports `nixl._api`; this venv has the CUDA wheel only (`nixl_cu12`), which
    the `nixl` meta package would alias. Alias it here the same way (and apply hybridkv's UCX defaults,
    as load_nixl does for hybridkv's agents, so both backends run under one UCX environment)."""
    import importlib
    import sys

    from hybridkv.transport.nixl_shim import load_nixl

    api = load_nixl()
    package = api.__name__.rsplit(".", 1)[0]
    if package != "nixl":
        sys.modules.setdefault("nixl", importlib.import_module(package))
        sys.modules.setdefault("nixl._api", api)


def _kv_class(backend: str, kind: str):
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    return get_kv_class(TransferBackend(backend), getattr(KVClassType, kind))


class _BenchState:
    """A rank's manager and pools; each public method is a command of `serve`."""

    def __init__(self) -> None:
        self.mgr = self.server = self.pools = self.counter = None
        self.backend = ""
        self.args = None
        self.peers: dict[int, object] = {}

    def setup(self, backend: str, role: str, tp: int, rank: int, bootstrap_port: int, seed, host_server: bool,
              shape: Shape, state: bool, staged: bool = False):
        """`backend`: "nixl" (SGLang's) or "hybridkv"; `state`: register the GDN state component; `staged`:
        hybridkv's staging at different TP on (HYBRIDKV_SGLANG_STAGING, read when the manager starts)."""
        self.teardown()
        if staged:
            os.environ["HYBRIDKV_SGLANG_STAGING"] = "on"
        else:
            os.environ.pop("HYBRIDKV_SGLANG_STAGING", None)
        use_shape(shape)
        sa = pd_peer.configure(role, port=pd_peer.free_port(), bootstrap_port=bootstrap_port, tp=tp, rank=rank)
        self.backend = backend
        if backend == "nixl":
            _nixl_under_its_own_name()
        if host_server:
            self.server = _kv_class(backend, "BOOTSTRAP_SERVER")("127.0.0.1", bootstrap_port)
        self.pools = pools.make_pools(seed, tp=tp, rank=rank, kv_heads=shape.kv_heads)
        args = self.pools.kv_args()
        args.kv_data_mem_kinds = ["DRAM"] * len(args.kv_data_ptrs)  # SGLang's NIXL: KV in host memory
        if not state:
            for name in ("state_types", "state_data_ptrs", "state_data_lens", "state_item_lens", "state_layer_ids",
                         "state_dim_per_tensor", "state_slice_outer_counts", "state_conv_shard_groups"):
                setattr(args, name, [])
        from sglang.srt.disaggregation.utils import DisaggregationMode

        mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
        self.args = args
        self.mgr = _kv_class(backend, "MANAGER")(args, mode, sa, False)
        agent = self.mgr.agent if backend == "nixl" else self.mgr.dp.agent
        self.counter = _Counting(agent) if role == "prefill" else None
        return True

    def teardown(self, _=None):
        if self.mgr is not None and hasattr(self.mgr, "close"):
            self.mgr.close()
        if self.server is not None and hasattr(self.server, "close"):
            self.server.close()
        self.mgr = self.server = self.pools = self.counter = None
        self.peers.clear()

    # prefill
    def sender(self, room: int):
        from sglang.srt.disaggregation.base.conn import KVPoll

        s = self.peers[room] = _kv_class(self.backend, "SENDER")(
            self.mgr, f"127.0.0.1:{self.mgr.bootstrap_port}", room)
        return int(pd_peer.wait_poll(s, {KVPoll.WaitingForInput, KVPoll.Failed}, timeout=60))

    def send_timed(self, room: int, chunks, slot, aux_row: int, t0: float, gap: float):
        """Chunk i (a page list) at t0 + i * gap; the state slot and aux row with the last.
        Returns (when the last chunk's send began, descriptors, posts) of this room."""
        s = self.peers[room]
        s.init(sum(len(c) for c in chunks), aux_row)
        d0, p0 = self.counter.descriptors, self.counter.posts
        last = 0.0
        for i, part in enumerate(chunks):
            while (wait := t0 + i * gap - time.monotonic()) > 0:
                time.sleep(min(wait, 0.002))
            is_last = i == len(chunks) - 1
            if is_last:
                last = time.monotonic()
            s.send(np.asarray(part, dtype=np.int32),
                   state_indices=[[slot]] if is_last and slot is not None else None)
        return last

    def finish(self, room: int, timeout: float = 60):
        """Wait for the sender's Success; (status, reason, descriptors, posts) of this rank so far."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        p = self.peers.pop(room)
        st = pd_peer.wait_poll(p, {KVPoll.Success, KVPoll.Failed}, timeout, step=0.0005)
        reason = pd_peer.failure_of(p) if st == KVPoll.Failed else None
        p.clear()
        c = self.counter
        return int(st), reason, (c.descriptors if c else 0), (c.posts if c else 0)

    # decode
    def receive(self, room: int, addr: str, pages, aux_row: int, slot):
        deadline = time.monotonic() + 30
        while not self.mgr.try_ensure_parallel_info(addr):
            if time.monotonic() > deadline:
                raise TimeoutError("prefill never registered to its bootstrap server")
            time.sleep(0.05)
        r = self.peers[room] = _kv_class(self.backend, "RECEIVER")(self.mgr, addr, room)
        r.init(0)
        r.send_metadata(np.asarray(pages, dtype=np.int32), aux_row, [[slot]] if slot is not None else None)
        return int(r.poll())

    def await_success(self, room: int, timeout: float = 60):
        """Poll the receiver as a decode scheduler would (tightly); (status, reason, when Success showed)."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        p = self.peers.pop(room)
        st = pd_peer.wait_poll(p, {KVPoll.Success, KVPoll.Failed}, timeout, step=0.0002)
        done = time.monotonic()
        reason = pd_peer.failure_of(p) if st == KVPoll.Failed else None
        p.clear()
        return int(st), reason, done

    def digests(self, pages, slot, aux_row, state: bool):
        """pools.named's fields of these blocks (state fields only with `state`), hashed: the landed bytes
        compared with the driver's own cut of the prefill's model state, without moving them over the pipe."""
        return digests(self.pools, pages, slot, aux_row, state)

    def landing_bytes(self, pages: int, state: bool):
        """Bytes a room of `pages` pages writes into this rank: its share of each page of each KV buffer,
        its aux row and (with `state`) its slice of one state slot."""
        a = self.args
        n = pages * sum(a.kv_item_lens) + sum(a.aux_item_lens)
        return n + (sum(sum(x) for x in a.state_item_lens) if state else 0)


def digests(p: pools.Pools, pages, slot, aux_row, state: bool) -> dict:
    import hashlib

    return {k: hashlib.sha1(v).hexdigest() for k, v in p.named(pages, slot if slot is not None else 0, aux_row).items()
            if state or k[0] in ("K", "V", "aux")}


def serve(conn) -> None:
    """Answer commands until "exit" with a `_BenchState` (pd_peer's loop)."""
    pd_peer.answer(conn, _BenchState())


class BenchRank(pd_peer.Rank):
    """pd_peer's rank process running this module's `serve`."""

    def __init__(self) -> None:
        super().__init__(serve)

    def close(self) -> None:
        # SGLang's NIXL manager has no close: its threads keep a rank process from exiting for ~10 s.
        # Once the rank answered "exit" (its bench is over), end it.
        super().close(grace_s=1.0)
