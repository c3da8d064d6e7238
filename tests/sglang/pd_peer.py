"""One rank of a real PD pair: SGLang's ServerArgs, runtime context, bootstrap
server and our manager on CPU, with pools shaped like a small hybrid model
(tests/sglang/pools.py).

A rank runs in a child process driven over a Pipe (`serve`), or in the pytest
process. Children fork from a forkserver that imported SGLang once (importing
it costs ~10 s of CPU per process), so several ranks are cheap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import traceback
import types

import numpy as np

from tests.sglang.pools import (  # noqa: F401 - re-exported for the tests
    ATTN_LAYERS,
    AUX_ROWS,
    GDN_LAYERS,
    KV_HEADS,
    MAMBA_SLOTS,
    NUM_PAGES,
    PAGE_SIZE,
    Pools,
    make_pools,
)

_PRELOAD = ["tests.sglang.pd_peer", "sglang.srt.disaggregation.common.conn", "sglang.srt.server_args",
            "sglang.srt.plugins", "hybridkv.transport.dataplane", "hybridkv.descriptors.compiler"]
_ctx = None


def context():
    """The forkserver context every rank process starts from (preloaded once per pytest run)."""
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(_PRELOAD)
    return _ctx


# The shared secret of ranks that run authenticated, as an operator sets it (HYBRIDKV_SGLANG_SECRET_ENV names
# the variable holding it); LAB_ENV unsets both: no secret, SGLang's unauthenticated lab mode.
# Hex of 32 random bytes, as `hybridkv secret FILE` writes one (a passphrase breaks auth.STRICT_SECRETS).
SECRET = "e7e4b2d31b850d7cae4f204c97cb20387ab357fadf05b978cb8ea07e88c5aea9"
#: With the secret, HYBRIDKV_SGLANG_INSECURE_HOST_MEMORY: these ranks' pools are host memory, which UCX serves over
#: tcp, shm and cma here (hybridkv.transport.host_memory), as a CPU deployment would accept by name.
SECRET_ENV = {"HYBRIDKV_SGLANG_SECRET_ENV": "HKV_TEST_SECRET", "HKV_TEST_SECRET": SECRET,
              "HYBRIDKV_SGLANG_INSECURE_HOST_MEMORY": "1"}
LAB_ENV = {"HYBRIDKV_SGLANG_SECRET_ENV": None, "HKV_TEST_SECRET": None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def bootstrap_server(env: dict):
    """hybridkv's bootstrap server in this process, its secret (or lab mode) read from `env` as a launch sets it."""
    import requests

    from hybridkv.connectors.sglang.bootstrap import HybridKVBootstrapServer

    keys = (*SECRET_ENV, "HYBRIDKV_SGLANG_INSECURE_NO_AUTH")
    saved = {k: os.environ.get(k) for k in keys}
    for k in keys:
        os.environ.pop(k, None)
    os.environ.update(env)
    try:
        port = free_port()
        srv = HybridKVBootstrapServer("127.0.0.1", port)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    addr = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while True:
        try:
            if requests.get(f"http://{addr}/health", timeout=1).status_code == 200:
                break
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, "the bootstrap server did not come up"
        time.sleep(0.05)
    try:
        yield addr
    finally:
        srv.close()


def configure(role: str, *, port: int, bootstrap_port: int, tp: int = 1, rank: int = 0, dp: int = 1, pp: int = 1):
    """SGLang's runtime context of TP rank `rank` of `tp` (of PP stage 0); `dp` > 1 is
    DP attention (`--enable-dp-attention --dp-size dp`: attention TP is tp // dp)."""
    os.environ["SGLANG_HOST_IP"] = "127.0.0.1"
    if os.environ.get("HYBRIDKV_SGLANG_SECRET_ENV") or os.environ.get("HYBRIDKV_SGLANG_SECRET_FILE"):
        os.environ.pop("HYBRIDKV_SGLANG_INSECURE_NO_AUTH", None)
    else:
        # A rank without a secret runs in lab mode by name, as an operator must once hybridkv requires secrets.
        os.environ.setdefault("HYBRIDKV_SGLANG_INSECURE_NO_AUTH", "1")
    os.environ.setdefault("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "2")
    # Two misses, not one: a loaded CI machine can miss one health check of a live peer.
    os.environ.setdefault("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "2")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    dp_attention = dict(dp_size=dp, enable_dp_attention=True) if dp > 1 else {}
    sa = ServerArgs(
        model_path="dummy", device="cpu", host="127.0.0.1", port=port, disaggregation_mode=role,
        disaggregation_transfer_backend="hybridkv", disaggregation_bootstrap_port=bootstrap_port, tp_size=tp,
        pp_size=pp, **dp_attention,
    )
    get_parallel().clear_stamp()  # a rank process may be set up again with another TP
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=rank))
    # No torch.distributed: the Common* managers only store the groups (they
    # talk to them when PP > 1), as in SGLang's own unit tests.
    par = get_parallel()
    get_parallel().override_permanently(pp_group=_RankGroup(par.pp_size, par.pp_rank),
                                        tp_group=_RankGroup(tp, par.tp_rank),
                                        attn_tp_group=_RankGroup(par.attn_tp_size, par.attn_tp_rank))
    return sa


class _RankGroup:
    def __init__(self, size: int, rank: int) -> None:
        self.world_size = size
        self.rank_in_group = self.rank = rank


def make_manager(role: str, pools: Pools, server_args):
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

    cls = get_kv_class(TransferBackend("hybridkv"), KVClassType.MANAGER)
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    return cls(pools.kv_args(), mode, server_args, False)


def kv_class(kind: str):
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    return get_kv_class(TransferBackend("hybridkv"), getattr(KVClassType, kind))


def wait_poll(obj, want, timeout: float = 20.0, step: float = 0.01):
    """Poll until the state is in `want` (a set of KVPoll values); return it."""
    deadline = time.monotonic() + timeout
    while True:
        s = obj.poll()
        if s in want or time.monotonic() > deadline:
            return s
        time.sleep(step)


def failure_of(obj) -> str | None:
    try:
        obj.failure_exception()
    except Exception as e:
        return str(e)
    return None


def receiver(mgr, addr: str, room: int, prefill_dp_rank: int = 0):
    """A decode receiver past init(), as SGLang's DecodePreallocQueue makes it."""
    deadline = time.monotonic() + 20
    while not mgr.try_ensure_parallel_info(addr):
        if time.monotonic() > deadline:
            raise TimeoutError("prefill never registered to its bootstrap server")
        time.sleep(0.1)
    r = kv_class("RECEIVER")(mgr, addr, room)
    r.init(prefill_dp_rank)
    return r


class BlockingEvent:
    """Stands in for the CUDA event a prefill chunk waits on (device work not
    finished); CPU has no such event, so the test opens it by hand."""

    def __init__(self, ctx) -> None:
        self._ev = ctx
        self.entered = threading.Event()  # a worker is blocked on it: the chunk is in flight

    def synchronize(self) -> None:
        self.entered.set()
        self._ev.wait(30)


# --------------------------------------------------------------------------- child process


class Rank:
    """A child process running `serve` (or another module's); `call` sends one command and returns its answer."""

    def __init__(self, target=None) -> None:
        ctx = context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target or serve, args=(child,), daemon=True)
        self.proc.start()

    def call(self, cmd, arg=None, timeout: float = 120):
        self.start(cmd, arg)
        return self.result(cmd, timeout)

    def start(self, cmd, arg=None) -> None:
        self.conn.send((cmd, arg))

    def result(self, cmd="?", timeout: float = 120):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"rank process did not answer {cmd!r}")
        tag, value = self.conn.recv()
        if tag != "ok":
            raise RuntimeError(f"rank process failed on {cmd!r}:\n{value}")
        return value

    def close(self, grace_s: float = 10.0) -> None:
        """Tell it to exit, wait ``grace_s`` for it to end once it answered, then kill it."""
        if self.proc.is_alive():
            try:
                self.conn.send(("exit", None))
                self.conn.poll(30)
            except Exception:
                pass
        self.proc.join(grace_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def serve(conn) -> None:
    """Answer commands until "exit" with a rank's `_State`."""
    answer(conn, _State())


def answer(conn, state) -> None:
    """Answer commands (a public method of `state` each) until "exit"; an exception is sent back, and the
    loop goes on."""
    while True:
        cmd, arg = conn.recv()
        if cmd == "exit":
            state.teardown()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(state, cmd)(*(arg if isinstance(arg, tuple) else (arg,)))))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class _State:
    """A rank's manager and pools; each public method is a command of `serve`."""

    def __init__(self) -> None:
        self.mgr = self.server = self.pools = None
        self.peers: dict[int, object] = {}  # room -> sender or receiver
        self.gates: dict[int, threading.Event] = {}
        self.queue = None  # decode: SGLang's DecodeTransferQueue (join_tp_group)
        self.free: set[tuple[str, int]] = set()  # decode: what that queue handed back to the allocator

    def setup(self, role: str, tp: int, rank: int, bootstrap_port: int, seed, host_server: bool,
              kv_heads: int = KV_HEADS, dp: int = 1):
        """`dp` > 1: DP attention; the pools are this rank's attention-TP slice (attention TP tp // dp)."""
        self.teardown()
        sa = configure(role, port=free_port(), bootstrap_port=bootstrap_port, tp=tp, rank=rank, dp=dp)
        if host_server:
            self.server = kv_class("BOOTSTRAP_SERVER")("127.0.0.1", bootstrap_port)
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        self.pools = make_pools(seed, tp=par.attn_tp_size, rank=par.attn_tp_rank, kv_heads=kv_heads)
        self.mgr = make_manager(role, self.pools, sa)
        return dict(agent=self.mgr.dp.name, attn_tp=par.attn_tp_size, attn_tp_rank=par.attn_tp_rank,
                    attn_dp_rank=par.attn_dp_rank, num_dp_ranks=par.num_dp_ranks, rank_port=int(self.mgr.rank_port),
                    metric_labels=dict(self.mgr.prom.labels) if self.mgr.prom is not None else None)

    def start_manager(self, role: str, env: dict, tp: int = 1, pp: int = 1, extra_state: str | None = None,
                      ib_device: str | None = None):
        """Build a manager as SGLang's scheduler would, with `env` set (TP rank 0 of `tp`, PP size
        `pp`, one more state component of type `extra_state`, `--disaggregation-ib-device ib_device`), then
        close it: {"error": what stopped it or None, "drain_timeout_s": its drain timeout}, and with
        `ib_device` set "ucx": the parameters NIXL's UCX backend of its agent was created with (NIXL's own
        get_backend_params)."""
        self.teardown()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        mgr = None
        try:
            sa = configure(role, port=free_port(), bootstrap_port=free_port(), tp=tp, pp=pp)
            self.pools = make_pools(None, tp=tp)
            args = self.pools.kv_args()
            if ib_device is not None:
                args.ib_device = ib_device
            if extra_state is not None:
                from sglang.srt.disaggregation.base.conn import StateType

                t = self.pools.aux  # any registered host buffer: the refusal comes before registration
                args.state_types.append(StateType(extra_state))
                for name, value in (("state_data_ptrs", t.data_ptr()), ("state_data_lens", t.nbytes),
                                    ("state_item_lens", t[0].nbytes), ("state_layer_ids", 0),
                                    ("state_dim_per_tensor", 0), ("state_slice_outer_counts", 1),
                                    ("state_conv_shard_groups", None)):
                    getattr(args, name).append([value])
            from sglang.srt.disaggregation.utils import DisaggregationMode

            mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
            mgr = kv_class("MANAGER")(args, mode, sa, False)
            started = dict(error=None, drain_timeout_s=mgr.drain_timeout_s)
            if ib_device is not None:
                started["ucx"] = dict(mgr.dp.agent.get_backend_params("UCX"))
            return started
        except Exception as e:
            return dict(error=f"{type(e).__name__}: {e}", drain_timeout_s=None)
        finally:
            if mgr is not None:
                mgr.close()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def backend_enum_after_plugins(self, _=None):
        """In a rank process that has not loaded SGLang's plugins yet: SGLang's TransferBackend members held
        from before load_plugins() (as a module that imported one at its top holds it) against the ones
        SGLang looks up after it."""
        from sglang.srt.disaggregation import utils

        cls, held = utils.TransferBackend, {m.name: m for m in utils.TransferBackend}
        from sglang.srt.plugins import load_plugins

        load_plugins()
        after = utils.TransferBackend
        return dict(same_class=after is cls, identical=all(after[n] is m for n, m in held.items()),
                    equal=all(after(m.value) == m for m in held.values()), hybridkv=after("hybridkv").name,
                    members=len(after))

    def secure_gates(self, on: bool):
        """hybridkv's secure-by-default gates in this rank process (transport.config.REQUIRE_SECRET,
        transport.auth.STRICT_SECRETS; on by default): as asked, returning what they were."""
        from hybridkv.transport import auth
        from hybridkv.transport import config as transport_config

        was = (transport_config.REQUIRE_SECRET, auth.STRICT_SECRETS)
        transport_config.REQUIRE_SECRET = auth.STRICT_SECRETS = bool(on)
        return was

    def setenv(self, env: dict):
        """Set (value) or unset (None) environment variables of this rank process."""
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def teardown(self, _=None):
        if self.queue is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.queue = None
            self.free.clear()
        if self.mgr is not None:
            self.mgr.close()
        if self.server is not None:
            self.server.close()
        self.mgr = self.server = self.pools = None
        self.peers.clear()

    # prefill commands
    def sender(self, room: int, wait: bool = True):
        """SGLang's sender for the room; under DP attention its __init__ registers this DP
        rank for the room with the bootstrap server (/register_dp_rank)."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        s = self.peers[room] = kv_class("SENDER")(self.mgr, f"127.0.0.1:{self.mgr.bootstrap_port}", room)
        return int(wait_poll(s, {KVPoll.WaitingForInput, KVPoll.Failed}) if wait else s.poll())

    def send(self, room: int, pages, slot, aux_row: int, chunks: int, gated: bool = False, last: bool = True):
        s = self.peers[room]
        s.init(len(pages), aux_row)
        parts = np.array_split(np.asarray(pages, dtype=np.int32), chunks)
        event = None
        for i, part in enumerate(parts):
            is_last = i == len(parts) - 1
            if is_last and not last:
                break  # the engine stalls before the last chunk
            if gated and i == 0:
                self.gates[room] = threading.Event()
                s._early_send_wait_event = event = BlockingEvent(self.gates[room])
            # slot None: a prefill that drops the Mamba state (as SGLang #23773 did).
            s.send(part, state_indices=[[slot]] if is_last and slot is not None else None)
        if event is not None and not event.entered.wait(30):
            raise RuntimeError(f"room {room}: no worker picked up the gated chunk")

    def send_tail(self, room: int, pages, slot, chunks: int):
        """The last chunk of a `send(..., last=False)`, with the state slot (None: no state)."""
        part = np.array_split(np.asarray(pages, dtype=np.int32), chunks)[-1]
        self.peers[room].send(part, state_indices=[[slot]] if slot is not None else None)

    def stop_server(self, _=None):
        """Stop the bootstrap server this rank hosts (SGLang runs it in the tokenizer-manager process: it
        can go while the scheduler ranks, and their writes, live on)."""
        self.server.close()
        self.server = None

    def abort_rooms(self, rooms, claim_timeout: float = 5.0):
        """SGLang's prefill-side abort of each room, as its abort paths do it (AbortReq, chunked prefill's
        _retire_aborted_prefill_result): once the room's METADATA is in, its sender is made and aborted, never
        cleared. Returns how many never got their METADATA claimed, the rooms still claimed here and the most
        rooms any authenticated session holds."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        mgr, never = self.mgr, 0
        for room in rooms:
            deadline = time.monotonic() + claim_timeout
            while room not in mgr.transfer_infos and time.monotonic() < deadline:
                time.sleep(0.0005)
            if room not in mgr.transfer_infos:
                never += 1
                claim_timeout = 0.05  # dropped (the session holds too many rooms): the rest fail fast
            s = kv_class("SENDER")(mgr, f"127.0.0.1:{mgr.bootstrap_port}", room)
            if s.poll() == KVPoll.WaitingForInput:
                s.init(1, 0)
            s.abort()
        gate = mgr.auth.gate
        held = max((len(x.rooms) for x in gate.by_peer.values()), default=0) if gate is not None else 0
        return dict(never_claimed=never, claimed=len(mgr.transfer_infos), session_rooms=held)

    def open_gate(self, room: int):
        self.gates.pop(room).set()

    def abort(self, room: int):
        self.peers[room].abort()

    def knows_agent(self, name: str):
        """NIXL's own answer: this rank's agent holds the metadata of remote agent `name`."""
        return bool(self.mgr.dp.agent.check_remote_metadata(name))

    def all_zero(self, _=None):
        """Nothing was ever written into this rank's pools (they start zeroed: seed None)."""
        return not any(t.count_nonzero().item() for t in self.pools.k + self.pools.v
                       + [self.pools.conv, self.pools.ssm, self.pools.aux])

    # decode commands
    def receive(self, room: int, addr: str, pages, aux_row: int, slot: int, prefill_dp_rank: int = 0):
        r = self.peers[room] = receiver(self.mgr, addr, room, prefill_dp_rank)
        r.send_metadata(np.asarray(pages, dtype=np.int32), aux_row, [[slot]])
        return int(r.poll())

    def query_dp_rank(self, addr: str, room: int, timeout: float = 20):
        """The prefill DP rank of the room, as SGLang's DecodePreallocQueue resolves it where
        rooms do not name it (CommonKVReceiver.query_prefill_dp_ranks, /query_dp_ranks)."""
        from sglang.srt.disaggregation.common.conn import CommonKVReceiver

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = CommonKVReceiver.query_prefill_dp_ranks(addr, [room]).get(str(room))
            if got is not None:
                return int(got)
            time.sleep(0.05)
        raise TimeoutError(f"no prefill DP rank registered room {room}")

    # both sides
    def poll(self, room: int):
        return int(self.peers[room].poll())

    def wait(self, room: int, timeout: float = 30):
        from sglang.srt.disaggregation.base.conn import KVPoll

        p = self.peers[room]
        st = wait_poll(p, {KVPoll.Success, KVPoll.Failed}, timeout)
        reason = failure_of(p) if st == KVPoll.Failed else None
        if st == KVPoll.Success:
            p.clear()
        return int(st), reason

    def bytes(self, pages, slot, aux_row):
        return self.pools.page_bytes(pages), self.pools.slot_bytes(slot), self.pools.aux_bytes(aux_row)

    def named(self, pages, slot, aux_row):
        return self.pools.named(pages, slot, aux_row)

    def zero(self, _=None):
        self.pools.zero()

    def patch(self, name: str, value):
        """Set a manager attribute (timeouts, lease) for a test."""
        target, attr = self.mgr, name
        if "." in name:
            head, attr = name.rsplit(".", 1)
            for part in head.split("."):
                target = getattr(target, part)
        setattr(target, attr, value)

    def fake_stuck(self, abort_ok: bool):
        """From now on every WRITE reads as still running, and an abort is accepted or
        refused as asked: a NIXL handle that hangs cannot be caused on one machine."""
        self.mgr.exports.dp = _StuckPlane(self.mgr.exports.dp, abort_ok)

    def unstick(self, _=None):
        """The hung WRITEs end (their real state shows again); the fake goes away."""
        fake = self.mgr.exports.dp
        fake.stuck = False
        self.mgr.exports.dp = fake.real
        return fake.aborts

    def hold_writes(self, agent=None, count=None):
        """From now on every WRITE (to decode agent `agent` only, if named; the next `count` only, if given) is
        held back (not posted, reads as running, NIXL refuses to abort it) until `release_held`: a handle that
        hangs, or a decode that stalls, cannot be caused on one machine."""
        self.mgr.exports.dp = _HeldPlane(self.mgr.exports.dp, only=agent, count=count)

    def held(self, _=None):
        return len(self.mgr.exports.dp.held)

    def release_held(self, _=None):
        """The held WRITEs are posted for real (a late write), wait for them to land; the fake stays
        until the watcher released them (it calls the fake's release), then goes away."""
        fake = self.mgr.exports.dp
        fake.post_held()
        deadline = time.monotonic() + 20
        while any(x.real is not None for x in fake.held) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.mgr.exports.dp = fake.real
        return len(fake.held)

    # decode: SGLang's own DecodeTransferQueue (decode.py) over this rank's receivers,
    # its TP group a real gloo group across the decode rank processes
    def join_tp_group(self, port: int, rank: int, world: int):
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.queue = _decode_transfer_queue(self)
        self.free.clear()

    def enqueue(self, room: int, addr: str, pages, slot: int):
        """As DecodePreallocQueue does: a metadata row (the aux row), send_metadata, then
        the request joins the transfer queue. Returns the aux row."""
        from sglang.srt.disaggregation.decode import DecodeRequest

        q = self.queue
        idx = q.req_to_metadata_buffer_idx_allocator.alloc()
        r = self.peers[room] = receiver(self.mgr, addr, room)
        r.send_metadata(np.asarray(pages, dtype=np.int32), idx, [[slot]])
        req = types.SimpleNamespace(rid=f"req-{room}", bootstrap_room=room, return_logprob=False,
                                    finished_reason=None, pages=[int(p) for p in pages], slot=int(slot))
        q.add(DecodeRequest(req=req, kv_receiver=r, metadata_buffer_index=idx))
        return idx

    def step(self, _=None):
        """One scheduler iteration of the transfer queue: pop_transferred (poll, MIN all-reduce
        over the TP group, failure handling and release or hold) and resolve_deferred_releases.
        Every decode rank must run it at once (collectives)."""
        q = self.queue
        q.pop_transferred()
        q.resolve_deferred_releases()
        return dict(free=sorted(self.free), free_aux=sorted(q.req_to_metadata_buffer_idx_allocator.free_slots),
                    queued=len(q.queue), held=q.num_pending_deferred_releases())

    def fill(self, pages, slot: int, value: int):
        """A running request the allocator handed these blocks to writes them."""
        self.pools.fill(pages, slot, value)

    def metrics(self, _=None):
        """Every sglang:hybridkv_* sample of this process's Prometheus registry, after the
        manager observed what it counted: {"name{label=value,...}": value}."""
        self.mgr.publish_metrics()
        return hybridkv_samples()

    def transfer_metric(self, room: int):
        """SGLang's own path for a finished room: the sender's KVTransferMetric, computed as the
        prefill scheduler does (SchedulerReqTimeStats.compute_and_observe_kv_transfer_metrics)."""
        from sglang.srt.observability.req_time_stats import SchedulerReqTimeStats

        metric = self.peers[room].get_transfer_metric()
        return dict(bytes=metric.transfer_total_bytes, latency_s=metric.transfer_latency_s,
                    computed=SchedulerReqTimeStats().compute_and_observe_kv_transfer_metrics(metric))

    def stats(self, room=None):
        mgr = self.mgr
        st = mgr.stats
        ex, imp = mgr.exports, mgr.imports  # the prefill's parts or the decode's (the other is None)
        with mgr.sched_lock:
            sched = dict(requests=mgr.sched.requests_in_flight(), transfers=mgr.sched.transfers_in_flight(),
                         exports={r: len(t) for r, t in ex._exports.items() if t} if ex else {},
                         fenced=sorted(mgr.fenced), imports=imp.rooms() if imp else [])
        return dict(chunks=st.chunks, handles=st.handles, descriptors=st.descriptors, bytes=st.bytes,
                    row_descriptors=st.row_descriptors, prepped_descriptors=st.prepped_descriptors,
                    pages=st.pages, inflight=dict(ex._inflight) if ex else {}, rooms=list(mgr.request_status),
                    transfer_infos=list(getattr(mgr, "transfer_infos", {})),
                    waiters=mgr.drains.waiting() if mgr.drains else {},
                    exporting=mgr.exporting(room) if room is not None else None, peers=len(mgr.peers),
                    retiring=mgr.retiring.agents() if mgr.retiring else [],
                    failures=dict(mgr.failure_records), stuck=len(ex._stuck) if ex else 0,
                    staging=mgr.staging_pool.describe() if mgr.staging_pool is not None else None,
                    staged=dict(descriptors=st.staged_descriptors, direct=st.staged_direct, slot=st.staged_slot),
                    auth=dataclasses.asdict(mgr.auth_stats), **sched)


class _StuckPlane:
    """DataPlane whose transfers never leave IN_PROGRESS while `stuck` (the fake of `fake_stuck`)."""

    def __init__(self, real, abort_ok: bool) -> None:
        self.real, self.abort_ok, self.stuck, self.aborts = real, abort_ok, True, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def state(self, xfer):
        from hybridkv.transport.dataplane import XferState

        return XferState.IN_PROGRESS if self.stuck else self.real.state(xfer)

    def poller(self, xfer):  # a waiter polls through this fake's state too (Side.wait_xfer)
        return lambda: self.state(xfer)

    def abort(self, xfer) -> bool:
        from hybridkv.transport.dataplane import XferState

        self.aborts.append(self.abort_ok)
        if not self.abort_ok:
            return False
        while self.real.state(xfer) is XferState.IN_PROGRESS:  # the real WRITE is tiny: let it end, then release
            time.sleep(0.001)
        self.real.release(xfer)
        return True


class _HeldXfer:
    handles = ()

    def __init__(self, args) -> None:
        self.args, self.real = args, None


class _HeldPlane:
    """DataPlane whose WRITEs (to agent `only`, if set) are held: `post_rows` records them and returns a
    stand-in that reads as IN_PROGRESS and that NIXL refuses to abort; `post_held` posts them for real
    (the fake of `hold_writes`)."""

    def __init__(self, real, only=None, count=None) -> None:
        self.real, self.held, self.aborts, self.only, self.count = real, [], [], only, count

    def __getattr__(self, name):
        return getattr(self.real, name)

    def post_rows(self, *args, **kwargs):
        if (self.only is not None and args[1] != self.only) or (self.count is not None and len(self.held) >= self.count):
            return self.real.post_rows(*args, **kwargs)
        x = _HeldXfer((args, kwargs))
        self.held.append(x)
        return x

    def post_held(self) -> None:
        from hybridkv.transport.dataplane import XferState

        for x in self.held:
            args, kwargs = x.args
            real = self.real.post_rows(*args, **kwargs)
            while self.real.state(real) is XferState.IN_PROGRESS:
                time.sleep(0.001)
            x.real = real

    def state(self, xfer):
        from hybridkv.transport.dataplane import XferState

        if isinstance(xfer, _HeldXfer):
            return XferState.IN_PROGRESS if xfer.real is None else self.real.state(xfer.real)
        return self.real.state(xfer)

    def poller(self, xfer):  # a waiter polls through this fake's state too (Side.wait_xfer)
        return lambda: self.state(xfer)

    def abort(self, xfer) -> bool:
        if not isinstance(xfer, _HeldXfer):
            return self.real.abort(xfer)
        self.aborts.append(False)
        return False

    def release(self, xfer) -> None:
        if isinstance(xfer, _HeldXfer):
            real, xfer.real = xfer.real, None
            if real is not None:
                self.real.release(real)
            return
        self.real.release(xfer)


def _decode_transfer_queue(state: _State):
    """SGLang's DecodeTransferQueue built by its own __init__, with stand-ins for what it
    reads of the scheduler on the transfer path. Its releases land in `state.free`:
    release_kv_cache (what frees a request's pages and Mamba slot to the allocator)
    is replaced by one that records them; metadata rows (the aux row) go back to
    SGLang's own ReqToMetadataIdxAllocator."""
    import torch
    import torch.distributed as dist

    try:
        import einops  # noqa: F401
    except ImportError:
        # Placeholder, named so: decode.py imports einops through the expert-distribution
        # metrics module, which the transfer path never calls; the test venv lacks it.
        sys.modules["einops"] = types.ModuleType("einops")
    from sglang.srt.disaggregation import decode as sg_decode
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from sglang.srt.runtime_context import get_parallel

    get_parallel().attn_tp_group.cpu_group = dist.group.WORLD

    def release_kv_cache(req, tree_cache, checkpoint=False):
        state.free.update(("page", p) for p in req.pages)
        state.free.add(("slot", req.slot))

    sg_decode.release_kv_cache = release_kv_cache
    ns = types.SimpleNamespace
    scheduler = ns(enable_decode_hicache=False, enable_hisparse=False, kv_checksum_computer=None,
                   spec_algorithm=None, disagg_decode_prealloc_queue=None,
                   metrics_reporter=ns(enable_metrics=False),
                   output_streamer=ns(stream_output=lambda reqs, return_logprob: None))
    metadata = ns(bootstrap_room=torch.zeros((AUX_ROWS, 1), dtype=torch.int64), clear_slot=lambda idx: None)
    tree_cache = ns(unlock=lambda lock: None)
    return sg_decode.DecodeTransferQueue(ReqToMetadataIdxAllocator(AUX_ROWS), metadata, scheduler, tree_cache)


def use_secret(ranks, secret: bool) -> None:
    """Each rank process reads the shared secret (or none: lab mode) at its next setup."""
    for r in ranks:
        r.call("setenv", SECRET_ENV if secret else LAB_ENV)


def check_auth(prefill, decode, secret: bool) -> None:
    """The ranks ran in the mode asked for. With a secret: every NIXL agent a prefill rank added came through a
    proven session, every decode rank proved itself to some prefill rank, and nothing was refused or dropped as
    unproven or foreign on any rank. Lab mode: no rank started a session."""
    st = {r: r.call("stats") for r in (*prefill, *decode)}
    for r, s in st.items():
        a = s["auth"]
        if not secret:
            assert a["sessions"] == 0, a
            continue
        assert a["refused"] == a["unproven"] == a["foreign"] == a["replayed"] == 0, a
        assert a["sessions"] == s["peers"] if r in prefill else a["sessions"] >= 1, (a, s["peers"])


def prefill_rank(seed: int = 7) -> tuple[Rank, int]:
    """A TP-1 prefill rank process hosting its bootstrap server; (rank, bootstrap port)."""
    r = Rank()
    port = free_port()
    r.call("setup", ("prefill", 1, 0, port, seed, True))
    return r, port


def hybridkv_samples() -> dict[str, float]:
    from prometheus_client import REGISTRY

    out = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name.startswith("sglang:hybridkv_") and not sample.name.endswith("_created"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out
