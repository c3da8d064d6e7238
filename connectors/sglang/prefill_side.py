"""Prefill side of the hybridkv SGLang backend: chunks become fenced exports.

Each chunk SGLang hands over joins the room's export in the fencing scheduler
(its source pages, and with the last chunk the state slots and aux row, are
assigned to the room) and the lane of the room's decode peers (transport/lanes.py: one
stalled decode holds one worker, never another decode's rooms); a worker
waits for the device (SGLang's event), takes a
`post_export` read, compiles one plan per component with the peer's planners,
posts them as one WRITE per decode peer (`DataPlane.post_rows`: one NIXL handle
per pair of memory kinds) and settles every one before the read is terminal. The
room's export is dropped, and its sender may report a terminal state, only when
no chunk of it is queued or being read.

Bounded (the core's rule for both directions, hybridkv/transport/bounded.py): a
chunk's WRITEs get `transfer_timeout_s` (and never past the export lease); past
it they are aborted, or, where NIXL refuses, kept quarantined while the room
fails (`_abandon`). The control thread expires export leases
(`TransferScheduler.poll`) and fails the rooms whose lease lapsed.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from hybridkv.connectors.sglang import messages as msgs
from hybridkv.connectors.sglang.adopt import KV_GROUP, AdoptedLayout, request_id, room_of, state_blocks
from hybridkv.connectors.sglang.config import SGLangConfig
from hybridkv.connectors.sglang.fenced_blocks import FencedBlocks
from hybridkv.connectors.sglang.rooms import Rooms
from hybridkv.connectors.sglang.staged_kv import PrefillStaging, StagedWrite
from hybridkv.fencing.fence import NotYet
from hybridkv.fencing.request_state import Component
from hybridkv.ids import TransferId
from hybridkv.transport import bounded
from hybridkv.transport import staging as st
from hybridkv.transport.dataplane import DataPlane, Op, Transfer
from hybridkv.transport.lanes import Lanes
from hybridkv.transport.metrics import FailureKind, TransferMetrics
from hybridkv.transport.plan import TransferPlan
from sglang.srt.disaggregation.base.conn import KVPoll

if TYPE_CHECKING:
    from hybridkv.connectors.sglang.registrations import Peer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Chunk:
    room: int
    kv_indices: np.ndarray
    index_slice: slice
    is_last: bool
    aux_index: Optional[int]
    state_indices: Optional[list]
    wait_event: Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class _StuckWrite:
    """Of WRITEs NIXL refused to abort (kept in `bounded.Unabortable`): the read stays in flight until they end."""

    room: int
    blocks: int = 0  # source blocks kept out of reuse until they end (for the metrics)
    slots: tuple = ()  # this rank's staging slots they read from, kept until they end


@dataclasses.dataclass
class TransferStats:
    """Counters a test or a benchmark reads; only worker threads write them."""

    chunks: int = 0
    handles: int = 0  # NIXL handles posted
    descriptors: int = 0
    bytes: int = 0
    pages: int = 0
    #: descriptors built per chunk as rows (initialize_xfer) and posted as indices into prepped lists
    row_descriptors: int = 0
    prepped_descriptors: int = 0
    #: KV at different TP through staging slots (staged_kv.py): descriptors, and chunks per route or fallen back
    staged_descriptors: int = 0
    staged_direct: int = 0
    staged_slot: int = 0


class PrefillExports:
    """The prefill manager's exports: `add_chunk` (SGLang's add_transfer_request) and the workers.

    Given the shared scheduler (`blocks`), SGLang's rooms, the layout, the NIXL data plane, the
    registered decode peers (read only: their planners), `on_settled`, called with a room
    each time a chunk or a stuck write of it ended, and `fail_room`, which fails a room on this rank
    (drains.py: its decode ranks are told Failed now and DRAINED once nothing of it is in flight)."""

    def __init__(self, *, blocks: FencedBlocks, rooms: Rooms, adopted: AdoptedLayout, dp: DataPlane,
                 peers: Mapping[str, Peer], config: SGLangConfig, metrics: TransferMetrics, stats: TransferStats,
                 on_settled: Callable[[int], None], fail_room: Callable[[int, str], None],
                 stop: threading.Event, staging: Optional[PrefillStaging] = None) -> None:
        self.blocks = blocks
        self.rooms = rooms
        self.adopted = adopted
        self.dp = dp  # an attribute: tests put a fake NIXL in its place
        self.peers = peers
        self.config = config
        self.metrics = metrics
        self.stats = stats
        self.on_settled = on_settled
        self.fail_room = fail_room
        self.stop = stop
        self.transfer_timeout_s = config.transfer_timeout_s  # an attribute: tests shorten it
        #: chunks to write, one lane per room's decode peers (a stalled decode holds one worker)
        self.lanes: Lanes[_Chunk] = Lanes()
        self._room_lane: dict[int, Hashable] = {}  # a room's lane while any chunk of it is queued or written
        self._inflight: dict[int, int] = defaultdict(int)  # chunks queued or being written
        self._exports: dict[int, set[TransferId]] = defaultdict(set)  # outbound reads in flight
        #: reads whose WRITEs NIXL would not abort
        self._stuck: bounded.Unabortable[TransferId, _StuckWrite] = bounded.Unabortable(blocks.lock)
        self._room_bytes: dict[int, int] = {}  # bytes this rank wrote per room (get_transfer_metric)
        #: this rank's staging pool (None: staging off)
        self.staging = staging
        #: per room and decode rank (ip, port): the decode pages [start, stop) written into its slot, flat
        self._slot_pages: dict[int, dict[tuple[str, int], list[int]]] = {}

    def add_chunk(self, room: int, kv_indices, index_slice: slice, is_last_chunk: bool,
                  aux_index: Optional[int], state_indices: Optional[list], wait_event) -> None:
        if is_last_chunk and aux_index is None:
            raise ValueError(f"room {room}: the last chunk needs an aux index")
        if not self.rooms.claimed(room):
            return None  # dummy rank, or cleared
        chunk = _Chunk(room=room, kv_indices=np.asarray(kv_indices, dtype=np.int64),
                       index_slice=index_slice, is_last=is_last_chunk, aux_index=aux_index,
                       state_indices=state_indices, wait_event=wait_event)
        try:
            with self.blocks.lock:
                self._hold_sources(chunk)
                self._inflight[room] += 1
                lane = self._room_lane.setdefault(room, self._lane_of(room))
        except ValueError as e:
            # Nothing was posted for this chunk; earlier ones (if any) may still be writing: decode
            # hears Failed now and DRAINED once they settled.
            self.fail_room(room, f"hybridkv refused the chunk: {e}")
            self.retire_export(room)
            return None
        self.rooms.update_status(room, KVPoll.Transferring)
        self.lanes.put(lane, chunk)
        return None

    def _lane_of(self, room: int) -> Hashable:
        """The decode agents that claimed the room: its chunks queue behind theirs only."""
        return tuple(sorted(md.agent_name for md in list((self.rooms.infos(room) or {}).values())
                            if not md.is_dummy))

    def _hold_sources(self, chunk: _Chunk) -> None:
        """The chunk's source blocks join the room's export (held until every read of them is terminal)."""
        rid = request_id(chunk.room)
        sched = self.blocks.sched
        if not sched.has_request(rid):
            sched.add_request(rid)
            sched.request_finished(rid, export=True)  # its blocks are read by outbound writes from now on
        wanted = [(KV_GROUP, chunk.kv_indices)]
        if chunk.is_last:
            for c, idx in state_blocks(chunk.state_indices):
                if c < self.adopted.num_state_groups:
                    wanted.append((self.adopted.state_group(c), idx))
            wanted.append((self.adopted.aux_group, np.asarray([chunk.aux_index], dtype=np.int64)))
        for group, blocks in wanted:
            size = sched.layout.pool_sizes[sched.layout.group_pools[group]]
            bad = [int(b) for b in blocks if not 0 <= int(b) < size]
            if bad:
                raise ValueError(f"source block {bad[0]} of group {group} is outside its pool (valid 0..{size - 1})")
        for group, blocks in wanted:
            held = set(int(b) for b in sched.blocks(rid, group))
            new = [int(b) for b in blocks if int(b) not in held]
            try:
                sched.assign(rid, group, new)
            except ValueError:
                # A prefix page shared with another live room (radix cache): that
                # room holds it; this room's reads are still counted by its own
                # export and gate its own sender.
                for b in new:
                    try:
                        sched.assign(rid, group, [b])
                    except ValueError:
                        pass

    # ------------------------------------------------------------ queries (senders, drains, retiring)
    def inflight(self, room: int) -> int:
        with self.blocks.lock:
            return self._inflight.get(room, 0)

    def drained(self, room: int) -> bool:
        """No chunk of the room is queued, being written or stuck."""
        with self.blocks.lock:
            return self._inflight.get(room, 0) == 0 and not any(w.room == room for w in self._stuck.payloads())

    def retire_export(self, room: int) -> None:
        """Drop the room's export once nothing of it is queued or being read and it is terminal."""
        with self.blocks.lock:
            if self._inflight.get(room, 0) > 0 or self._exports.get(room):
                return
            self._exports.pop(room, None)
            status = self.rooms.status(room)
            if status is None or status in (KVPoll.Success, KVPoll.Failed):
                # only now: between two chunks nothing may be in flight, yet the staged pages so far must
                # reach the room's LANDED (its last chunk), or the decode leaves them in its slot
                self._slot_pages.pop(room, None)
                self.blocks.drop(request_id(room), export=True)

    def take_room_bytes(self, room: int) -> Optional[int]:
        """Bytes this rank wrote for the room (every chunk), once; None if it wrote none."""
        with self.blocks.lock:
            return self._room_bytes.pop(room, None)

    def exporting(self, room: int) -> bool:
        with self.blocks.lock:
            return self.blocks.sched.has_request(request_id(room))

    # ------------------------------------------------------------ workers
    def worker_loop(self) -> None:
        while not self.stop.is_set():
            got = self.lanes.take(self.config.poll_interval_s)
            if got is None:
                continue
            lane, chunk = got
            try:
                self._process(chunk)
            except Exception:
                logger.exception("hybridkv: worker failed on room %s", chunk.room)
            finally:
                with self.blocks.lock:
                    self._inflight[chunk.room] -= 1
                    if self._inflight[chunk.room] <= 0:
                        del self._inflight[chunk.room]
                        self._room_lane.pop(chunk.room, None)
                self.lanes.done(lane)
                self.retire_export(chunk.room)
                self.on_settled(chunk.room)

    def _plans_for(self, chunk: _Chunk, md: msgs.Metadata, peer: Peer, slots: list
                   ) -> tuple[list[tuple[Component, Optional[TransferPlan]]], Optional[tuple[np.ndarray, np.ndarray]],
                              Optional[StagedWrite]]:
        """Per component, the compiled plan, and the KV pages (src, dst) that go through the peer's prepped
        lists instead (different TP: sliced_lists.py), or the staged WRITE that carries them (staged_kv.py; its
        slot is appended to ``slots``). Raises ValueError before anything is posted."""
        dst_pages = md.kv_indices[chunk.index_slice]
        if len(dst_pages) != len(chunk.kv_indices):
            raise ValueError(
                f"room {chunk.room}: {len(chunk.kv_indices)} source pages for {len(dst_pages)} destination pages"
            )
        blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {KV_GROUP: (chunk.kv_indices, dst_pages)}
        if chunk.is_last:
            for c, idx in state_blocks(chunk.state_indices):
                if c >= len(md.state_indices) or md.state_indices[c] is None:
                    raise ValueError(f"room {chunk.room}: decode sent no destination for state component {c}")
                blocks[self.adopted.state_group(c)] = (idx, md.state_indices[c])
            if md.aux_index < 0:
                raise ValueError(f"room {chunk.room}: decode sent no aux index")
            blocks[self.adopted.aux_group] = (np.asarray([int(chunk.aux_index)]), np.asarray([md.aux_index]))
        out = []
        prepped = staged = None
        for comp, planner in peer.planners.items():
            if comp.group not in blocks:
                continue
            if planner is None:
                # Another prefill rank writes every field of it (heads this rank
                # shares with it, replicated state, aux): done here by definition.
                out.append((comp, None))
                continue
            src, dst = blocks[comp.group]
            if peer.kv_lists is not None and comp.group == KV_GROUP:
                peer.kv_lists.indices(src, dst)  # checked here, before anything is posted
                staged = self._stage(chunk, md, peer, src, dst)
                if staged is None:
                    prepped = (src, dst)
                else:
                    slots.append(staged.slot)
                out.append((comp, None))
                continue
            out.append((comp, planner.compile({comp.group: src}, {comp.group: dst})))
        return out, prepped, staged

    def _stage(self, chunk: _Chunk, md: msgs.Metadata, peer: Peer, src: np.ndarray,
               dst: np.ndarray) -> Optional[StagedWrite]:
        """The chunk's KV for this decode rank packed into a staging slot, or None: sliced (staging off, the
        route, or a full pool)."""
        if self.staging is None or peer.staged is None or not len(src):
            return None
        start, stop, _ = chunk.index_slice.indices(len(md.kv_indices))
        rank = self.rooms.prefill_rank()
        offer = next(((s.offset, s.nbytes) for s in md.staging if s.prefill_rank == rank), None)
        return self.staging.prepare(peer.staged, src, dst, (start, stop), offer,
                                    sliced=peer.kv_lists.pieces * len(src))

    def _post(self, agent: str, peer: Peer, plan: TransferPlan, prepped,
              staged: Optional[StagedWrite] = None) -> Iterator[tuple[Transfer, int, int]]:
        """The chunk's WRITEs to one decode agent, each with its descriptors and bytes: its KV slices through
        the prepped lists or from a staging slot, the rest as rows."""
        if staged is not None:
            xfer = self.dp.post_rows(Op.WRITE, agent, staged.local, staged.remote)
            n = len(staged.local)
            self.stats.staged_descriptors += n
            if staged.route is st.Route.DIRECT:
                self.stats.staged_direct += 1
            else:
                self.stats.staged_slot += 1
            yield xfer, n, staged.nbytes
        if prepped is not None:
            src, dst = prepped
            xfer = peer.kv_lists.post(Op.WRITE, src, dst)
            n = peer.kv_lists.pieces * len(src)
            self.stats.prepped_descriptors += n
            yield xfer, n, peer.kv_lists.nbytes(len(src))
        if plan.num_descriptors:
            self.stats.row_descriptors += plan.num_descriptors
            yield self.dp.post_rows(Op.WRITE, agent, plan.src, plan.dst), plan.num_descriptors, plan.nbytes

    def _process(self, chunk: _Chunk) -> None:
        room = chunk.room
        rid = request_id(room)
        status = self.rooms.status(room)
        infos = self.rooms.infos(room)
        if status is None or status == KVPoll.Failed or infos is None:
            return  # aborted or cleared: nothing is written for it
        if chunk.wait_event is not None and hasattr(chunk.wait_event, "synchronize"):
            chunk.wait_event.synchronize()  # export fence: the device finished writing the source
            if self.rooms.status(room) in (None, KVPoll.Failed):
                return  # aborted while the device was still writing the source
        self.rooms.update_status(room, KVPoll.Transferring)
        xfers: list[Transfer] = []
        tid = None
        sent: list[Component] = []
        error: Optional[Exception] = None
        deadline = time.monotonic() + self.transfer_timeout_s
        t0 = time.perf_counter()
        nbytes = descriptors = 0
        post_seconds = 0.0
        slots: list = []  # this rank's staging slots the chunk's WRITEs read (back once they ended)
        try:
            targets = [(md, self.peers[md.agent_name]) for md in list(infos.values()) if not md.is_dummy]
            plans = [(md, peer, *self._plans_for(chunk, md, peer, slots)) for md, peer in targets]
            with self.blocks.lock:
                sched = self.blocks.sched
                sched.heartbeat(rid)
                posted = sched.post_export(rid)
                if isinstance(posted, NotYet):
                    raise RuntimeError(f"the scheduler refused the read of room {room}: {posted.reason.value}")
                tid = posted
                self._exports[room].add(tid)
                lease = sched.leases.deadline(rid)
            # A write past its export lease reads pages that may be released: abort it there.
            deadline = min(deadline, lease) if lease is not None else deadline
            for md, peer, comp_plans, prepped, staged in plans:
                plan = TransferPlan.concat([p for _, p in comp_plans if p is not None and p.num_descriptors])
                for xfer, n, size in self._post(md.agent_name, peer, plan, prepped, staged):
                    xfers.append(xfer)  # each as soon as it runs: it settles below whatever fails next
                    self.stats.handles += len(xfer.handles)
                    self.stats.descriptors += n
                    self.stats.bytes += size
                    nbytes += size
                    descriptors += n
                for comp, _ in comp_plans:
                    if comp not in sent:
                        sent.append(comp)
            self.stats.chunks += 1
            self.stats.pages += len(chunk.kv_indices)
            post_seconds = time.perf_counter() - t0
        except Exception as e:
            error = e  # WRITEs already posted still settle below
        settled = bounded.settle(self.dp, xfers, deadline, self.config.settle_poll_s)
        failed, running = settled.errors, settled.running
        if running:
            self._abandon(room, tid, xfers, running, error, slots)
            return
        for x in xfers:
            self.dp.release(x)
        if slots:
            self.staging.give_back(slots)  # every WRITE that read them ended
        if error is None and not failed:
            with self.blocks.lock:
                for md, _, _, _, staged in plans:
                    if staged is not None and staged.route is st.Route.SLOT:
                        got = self._slot_pages.setdefault(room, {}).setdefault((md.endpoint, md.port), [])
                        got.extend(staged.pages)
        if error is None and failed:
            error = RuntimeError(f"NIXL reported an error for {failed} of {len(xfers)} WRITEs of room {room}")
        if error is None and xfers:
            self.metrics.transfer(nbytes=nbytes, descriptors=descriptors, seconds=time.perf_counter() - t0,
                                  post_seconds=post_seconds)
            with self.blocks.lock:
                self._room_bytes[room] = self._room_bytes.get(room, 0) + nbytes
        if error is not None:
            self.metrics.failure(FailureKind.TRANSFER)
            self.fail_room(room, f"hybridkv transfer failed: {error}")
            self._end_export(room, tid, ok=False)
            return
        self._end_export(room, tid, ok=True)
        if chunk.is_last:
            # Every chunk of the room ran before this one, in order, on its lane, and settled:
            # the KV component is complete with this one.
            rank = self.rooms.prefill_rank()
            with self.blocks.lock:
                slot_pages = self._slot_pages.pop(room, {})
            for (ip, port), gen in self.rooms.generations(room).items():
                landed = msgs.Landed(room=room, prefill_rank=rank, components=tuple(sent), generation=gen,
                                     staged=tuple(slot_pages.get((ip, port), ())))
                self.rooms.push(ip, port, landed.to_frames(), f"LANDED for room {room}")
            self.rooms.conclude_success(room)
            if self.rooms.check_status(room) == KVPoll.Success:
                self.rooms.forget_claims(room)

    def _abandon(self, room: int, tid: Optional[TransferId], xfers: list[Transfer], running: Sequence[Transfer],
                 error: Optional[Exception], slots: Sequence = ()) -> None:
        """WRITEs still running past the transfer timeout or the export lease: abort them.
        Aborted, the room fails like any failed transfer. One NIXL will not abort may still
        write: its read stays in flight in the scheduler, decode is told (STUCK, before
        the Failed status) to keep the room's pages until DRAINED, and the room fails now
        instead of hanging; the watcher ends the read once NIXL settles the handle."""
        self.metrics.failure(FailureKind.TIMEOUT)
        refused = bounded.abort_or_keep(self.dp, xfers, running)
        why = (f"hybridkv: writes of room {room} still running after {self.transfer_timeout_s:.0f} s "
               f"or past the export lease" + (f" (and: {error})" if error else ""))
        if not refused:
            if slots:
                self.staging.give_back(slots)  # aborted: nothing reads them any more
            self.fail_room(room, why + "; aborted")
            self._end_export(room, tid, ok=False)
            return
        with self.blocks.lock:
            # Handles exist only after the read was posted, so tid is set. The room may
            # end now; the scheduler keeps its source blocks out of reuse until then.
            self._exports[room].discard(tid)
            held = self.blocks.count(request_id(room))
            self._stuck.keep(tid, refused, _StuckWrite(room=room, blocks=held, slots=tuple(slots)))
        self.metrics.quarantined(held)
        rank = self.rooms.prefill_rank()
        for (ip, port), gen in self.rooms.generations(room).items():
            frames = msgs.Stuck(room=room, prefill_rank=rank, generation=gen).to_frames()
            self.rooms.push(ip, port, frames, f"STUCK for room {room}")
        logger.error("hybridkv: room %s: NIXL refused to abort %d write(s); its pages stay quarantined",
                     room, len(refused))
        self.fail_room(room, (
            why + f"; NIXL refused to abort {len(refused)} of them: the decode pages stay quarantined until "
            "they end"))

    # ------------------------------------------------------------ control thread, every loop
    def expire_leases(self) -> None:
        with self.blocks.lock:
            sched = self.blocks.sched
            now = sched.leases.now()
            for rid in sched.request_ids():
                d = sched.leases.deadline(rid)
                if d is not None and d < now:
                    self.blocks.fenced.update(self.blocks.blocks(rid))
            lapsed = sched.poll()  # releases their blocks (a read in flight keeps its own fenced)
            self.blocks.collect_reusable()
        for rid in lapsed:
            self.metrics.lease_expired()
            room = room_of(rid)
            if self.rooms.status(room) not in (None, KVPoll.Success, KVPoll.Failed):
                self.fail_room(room, (
                    f"hybridkv: the export lease of room {room} lapsed ({sched.leases.duration_s:.0f} s "
                    "without a chunk); its source pages are released"))

    def watch_stuck(self) -> None:
        """End the reads whose WRITEs NIXL would not abort once NIXL settled them."""
        def end(tid: TransferId, _: _StuckWrite) -> None:
            self.blocks.sched.transfer_failed(tid)
            self.blocks.collect_reusable()

        for stuck in self._stuck.reap(self.dp, end):
            if stuck.slots:
                self.staging.give_back(stuck.slots)  # its staging slots too, only now
            self.metrics.quarantine_released(stuck.blocks)
            logger.info("hybridkv: room %s: the write NIXL would not abort has ended", stuck.room)
            self.on_settled(stuck.room)  # DRAINED to the decode ranks once nothing else of the room is in flight

    def _end_export(self, room: int, tid: Optional[TransferId], *, ok: bool) -> None:
        if tid is None:
            return
        with self.blocks.lock:
            self._exports[room].discard(tid)
            if ok:
                self.blocks.sched.transfer_landed(tid)
            else:
                self.blocks.sched.transfer_failed(tid)
            self.blocks.collect_reusable()
