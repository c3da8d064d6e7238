"""One side of a real PD pair: SGLang's ServerArgs, runtime context, bootstrap
server and our manager on CPU, with pools shaped like a small hybrid model.

The prefill runs in a child process (spawned) driven over a Pipe; the decode
runs in the pytest process. Memory is laid out as SGLang allocates it: one
tensor per full-attention layer for K and for V (item = one page of one
layer), and per Mamba state tensor one [layers, slots + 1, ...] tensor whose
per-layer slices are the `state_data_ptrs` (item = one slot).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

PAGE_SIZE = 4
NUM_PAGES = 64
KV_HEADS, HEAD_DIM = 2, 16
ATTN_LAYERS = (3, 7)  # Qwen3.5-style: every 4th layer is full attention
GDN_LAYERS = (0, 1, 2, 4, 5, 6)
CONV_SHAPE = (96, 3)  # (conv_dim, kernel - 1)
SSM_SHAPE = (4, 8, 8)  # (v heads, dv, dk)
MAMBA_SLOTS = 8
AUX_ROWS, AUX_ITEM = 16, 64


def configure(role: str, *, port: int, bootstrap_port: int):
    os.environ["SGLANG_HOST_IP"] = "127.0.0.1"
    os.environ.setdefault("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "2")
    # Two misses, not one: a loaded CI machine can miss one health check of a live peer.
    os.environ.setdefault("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "2")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path="dummy", device="cpu", host="127.0.0.1", port=port, disaggregation_mode=role,
        disaggregation_transfer_backend="hybridkv", disaggregation_bootstrap_port=bootstrap_port,
    )
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0))
    from sglang.srt.runtime_context import get_parallel

    # One rank, no torch.distributed: the Common* managers only store the
    # groups (they talk to them when PP > 1), as in SGLang's own unit tests.
    get_parallel().override_permanently(pp_group=_SingleRankGroup(), tp_group=_SingleRankGroup(),
                            attn_tp_group=_SingleRankGroup())
    return sa


class _SingleRankGroup:
    world_size = 1
    rank_in_group = 0
    rank = 0


@dataclass
class Pools:
    k: list
    v: list
    conv: object
    ssm: object
    aux: object

    def kv_args(self):
        from sglang.srt.disaggregation.base.conn import KVArgs, StateType

        a = KVArgs()
        a.engine_rank = 0
        bufs = self.k + self.v
        a.kv_data_ptrs = [t.data_ptr() for t in bufs]
        a.kv_data_lens = [t.nbytes for t in bufs]
        a.kv_item_lens = [t[0].nbytes * PAGE_SIZE for t in bufs]
        a.kv_layer_ids = list(ATTN_LAYERS) * 2
        a.kv_cache_dtype_str = "bfloat16"
        a.page_size = PAGE_SIZE
        a.kv_head_num = a.total_kv_head_num = KV_HEADS
        a.aux_data_ptrs = [self.aux.data_ptr()]
        a.aux_data_lens = [self.aux.nbytes]
        a.aux_item_lens = [self.aux[0].nbytes]
        state = [self.conv[i] for i in range(len(GDN_LAYERS))] + [self.ssm[i] for i in range(len(GDN_LAYERS))]
        a.state_types = [StateType.MAMBA]
        a.state_data_ptrs = [[t.data_ptr() for t in state]]
        a.state_data_lens = [[t.nbytes for t in state]]
        a.state_item_lens = [[t[0].nbytes for t in state]]
        a.state_layer_ids = [list(GDN_LAYERS) * 2]
        a.state_dim_per_tensor = [[t.shape[1] for t in state]]
        a.state_slice_outer_counts = [[1] * len(state)]
        a.state_conv_shard_groups = [[None] * len(state)]
        a.is_hybrid_mla_backend = False
        a.swa_kv_cache_layout = None
        a.ib_device = ""
        a.gpu_id = 0
        a.system_dp_rank = 0
        a.rust_http_port = None
        a.pp_rank = 0
        a.prefill_start_layer = 0
        a.prefill_end_layer = None
        a.mla_compression_ratios = None
        return a

    def page_bytes(self, pages) -> list[bytes]:
        out = []
        for t in self.k + self.v:
            for p in pages:
                out.append(t[p * PAGE_SIZE:(p + 1) * PAGE_SIZE].contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
        return out

    def slot_bytes(self, slot: int) -> list[bytes]:
        import torch

        return [t[i, slot].contiguous().view(torch.uint8).numpy().tobytes()
                for t in (self.conv, self.ssm) for i in range(len(GDN_LAYERS))]

    def zero(self) -> None:
        for t in self.k + self.v + [self.conv, self.ssm, self.aux]:
            t.zero_()

    def aux_bytes(self, row: int) -> bytes:
        return self.aux[row].numpy().tobytes()


def make_pools(seed: int | None) -> Pools:
    """Random contents for a prefill (seed), zeros for a decode (None)."""
    import torch

    g = torch.Generator().manual_seed(seed or 0)

    def t(*shape, dtype=torch.bfloat16):
        if seed is None:
            return torch.zeros(*shape, dtype=dtype)
        if dtype is torch.uint8:
            return torch.randint(0, 255, shape, generator=g, dtype=dtype)
        return torch.randn(*shape, generator=g).to(dtype)

    tokens = (NUM_PAGES + 1) * PAGE_SIZE  # SGLang keeps one padding page
    return Pools(
        k=[t(tokens, KV_HEADS, HEAD_DIM) for _ in ATTN_LAYERS],
        v=[t(tokens, KV_HEADS, HEAD_DIM) for _ in ATTN_LAYERS],
        conv=t(len(GDN_LAYERS), MAMBA_SLOTS + 1, *CONV_SHAPE),
        ssm=t(len(GDN_LAYERS), MAMBA_SLOTS + 1, *SSM_SHAPE, dtype=torch.float32) if seed is None
        else torch.randn(len(GDN_LAYERS), MAMBA_SLOTS + 1, *SSM_SHAPE, generator=g),
        aux=t(AUX_ROWS, AUX_ITEM, dtype=torch.uint8),
    )


def make_manager(role: str, pools: Pools, server_args):
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

    cls = get_kv_class(TransferBackend("hybridkv"), KVClassType.MANAGER)
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    return cls(pools.kv_args(), mode, server_args, False)


def wait_poll(obj, want, timeout: float = 20.0, step: float = 0.01):
    """Poll until the state is in `want` (a set of KVPoll values); return it."""
    deadline = time.monotonic() + timeout
    while True:
        s = obj.poll()
        if s in want or time.monotonic() > deadline:
            return s
        time.sleep(step)


class BlockingEvent:
    """Stands in for the CUDA event a prefill chunk waits on (device work not
    finished); CPU has no such event, so the test opens it by hand."""

    def __init__(self, ctx) -> None:
        import threading

        self._ev = ctx
        self.entered = threading.Event()  # a worker is blocked on it: the chunk is in flight

    def synchronize(self) -> None:
        self.entered.set()
        self._ev.wait(30)


def prefill_main(conn, port: int, bootstrap_port: int, seed: int) -> None:
    import traceback

    try:
        _prefill_main(conn, port, bootstrap_port, seed)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def _prefill_main(conn, port: int, bootstrap_port: int, seed: int) -> None:
    import threading

    # Imported after configure(): load_plugins() replaces the enum, and a
    # local bound earlier would keep the old one.
    sa = configure("prefill", port=port, bootstrap_port=bootstrap_port)
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    server = get_kv_class(TransferBackend("hybridkv"), KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", bootstrap_port)
    pools = make_pools(seed)
    mgr = make_manager("prefill", pools, sa)
    sender_cls = get_kv_class(TransferBackend("hybridkv"), KVClassType.SENDER)
    senders = {}
    gates = {}
    conn.send(("ready", None))
    while True:
        cmd, arg = conn.recv()
        if cmd == "exit":
            break
        if cmd == "sender":
            room = arg
            senders[room] = sender_cls(mgr, f"127.0.0.1:{bootstrap_port}", room)
            conn.send(("ok", wait_poll(senders[room], {KVPoll.WaitingForInput, KVPoll.Failed})))
        elif cmd == "sender_nowait":
            room = arg
            senders[room] = sender_cls(mgr, f"127.0.0.1:{bootstrap_port}", room)
            conn.send(("ok", int(senders[room].poll())))
        elif cmd == "send":
            room, pages, slot, aux_row, chunks, gated = arg
            s = senders[room]
            s.init(len(pages), aux_row)
            parts = np.array_split(np.asarray(pages, dtype=np.int32), chunks)
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                if gated and i == 0:
                    gates[room] = threading.Event()
                    s._early_send_wait_event = event = BlockingEvent(gates[room])
                # slot None: a prefill that drops the Mamba state (as SGLang #23773 did).
                s.send(part, state_indices=[[slot]] if last and slot is not None else None)
            if gated and not event.entered.wait(30):
                raise RuntimeError(f"room {room}: no worker picked up the gated chunk")
            conn.send(("ok", None))
        elif cmd == "open_gate":
            gates.pop(arg).set()
            conn.send(("ok", None))
        elif cmd == "poll":
            conn.send(("ok", int(senders[arg].poll())))
        elif cmd == "wait":
            room, timeout = arg
            st = wait_poll(senders[room], {KVPoll.Success, KVPoll.Failed}, timeout)
            reason = None
            if st == KVPoll.Failed:
                try:
                    senders[room].failure_exception()
                except Exception as e:
                    reason = str(e)
            else:
                senders[room].clear()
            conn.send(("ok", (int(st), reason)))
        elif cmd == "abort":
            senders[arg].abort()
            conn.send(("ok", None))
        elif cmd == "bytes":
            pages, slot, aux_row = arg
            conn.send(("ok", (pools.page_bytes(pages), pools.slot_bytes(slot), pools.aux_bytes(aux_row))))
        elif cmd == "stats":
            st = mgr.stats
            with mgr.sched_lock:
                sched = dict(requests=mgr.sched.requests_in_flight(), transfers=mgr.sched.transfers_in_flight(),
                             exports={r: len(t) for r, t in mgr._exports.items() if t}, fenced=sorted(mgr.fenced))
            conn.send(("ok", dict(chunks=st.chunks, handles=st.handles, descriptors=st.descriptors, bytes=st.bytes,
                                  pages=st.pages, inflight=dict(mgr._inflight), rooms=list(mgr.request_status),
                                  transfer_infos=list(mgr.transfer_infos), waiters=dict(mgr._drain_waiters),
                                  exporting=mgr.exporting(arg) if arg is not None else None, **sched)))
    mgr.close()
    server.close()
    conn.send(("bye", None))
