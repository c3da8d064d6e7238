"""Prefill side: what decode ranks send a prefill rank about themselves and their rooms.

REGISTER (a decode rank's NIXL agent and layout): the agent is added to NIXL and paired with this
rank (pairing.py), or kept with the reason it cannot be (every room it claims then fails).
METADATA (a room's destinations): the room waits for input once every destination rank claimed it.
ABORT (SGLang's): the room fails, and the decode rank is told DRAINED once nothing of the room is
in flight here (drains.py). With a secret, each comes within a proven session, and a decode rank
names only its own address and agent and claims only rooms no other decode rank holds (peer_auth.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import MutableMapping
from typing import Optional

from hybridkv.connectors.sglang import messages as msgs
from hybridkv.connectors.sglang.adopt import KV_GROUP, AdoptedLayout, from_peer
from hybridkv.connectors.sglang.drains import Drains
from hybridkv.connectors.sglang.pairing import PeerPlan, plan_peer
from hybridkv.connectors.sglang.peer_auth import PeerAuth
from hybridkv.connectors.sglang.prefill_side import PrefillExports
from hybridkv.connectors.sglang.retiring import RetiringAgents
from hybridkv.connectors.sglang.rooms import Rooms
from hybridkv.connectors.sglang.sessions import Session
from hybridkv.connectors.sglang.sliced_lists import sliced_kv
from hybridkv.connectors.sglang.staged_kv import StagedPeer, decode_region
from hybridkv.descriptors.compiler import TransferPlanner
from hybridkv.fencing.request_state import Component, ComponentKind
from hybridkv.ids import GroupId
from hybridkv.transport.dataplane import DataPlane
from hybridkv.transport.piece_lists import PieceLists
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification

logger = logging.getLogger(__name__)

_MAX_REFUSED = 1 << 16
_REFUSAL_TTL_S = 300.0  # SGLang's bootstrap timeout: a sender made later than this is another request's


@dataclasses.dataclass
class Peer:
    """A registered decode rank's NIXL agent."""

    agent_name: str
    layout: AdoptedLayout
    planners: dict[Component, Optional[TransferPlanner]]  # None: another prefill rank writes these fields
    plan: Optional[PeerPlan]
    rejection: Optional[str]
    #: different attention TP: the KV slices as prepped lists, made once per agent (sliced_lists.py)
    kv_lists: Optional[PieceLists] = None
    #: different attention TP with staging on: what this rank packs for the agent (staged_kv.py)
    staged: Optional[StagedPeer] = None


class Registrations:
    """The prefill manager's control messages from decode ranks. Given this rank's layout and data plane, the
    registered peers (this adds them), SGLang's rooms, the authentication, and the exports, drains and
    retiring agents an ABORT or a new agent touches."""

    def __init__(self, *, adopted: AdoptedLayout, dp: DataPlane, peers: MutableMapping[str, Peer], rooms: Rooms,
                 auth: PeerAuth, exports: PrefillExports, drains: Drains, retiring: RetiringAgents) -> None:
        self.adopted = adopted
        self.dp = dp
        self.peers = peers
        self.rooms = rooms
        self.auth = auth
        self.exports = exports
        self.drains = drains
        self.retiring = retiring
        # rooms refused before SGLang made their sender -> why, and when; the sender fails when made (bounded: a
        # room whose sender never comes is forgotten, oldest first, and after _REFUSAL_TTL_S)
        self._refused: OrderedDict[int, tuple[str, float]] = OrderedDict()

    def on_message(self, session: Optional[Session], frames: list[bytes]) -> None:
        """What a decode rank sent (opened by the authentication): SGLang's ABORT, or REGISTER / METADATA."""
        if frames and frames[0] == ABORT_TAG:
            return self.on_abort(frames, session)
        m = msgs.decode(frames) if frames and frames[0] == msgs.TAG else None
        if isinstance(m, msgs.Register):
            self.on_register(m, session)
        elif isinstance(m, msgs.Metadata):
            self.on_metadata(m, session)
        else:
            raise ValueError(f"prefill got {type(m).__name__ if m else f'the tag {frames[0][:16]!r}'}; expected "
                             "ABORT, REGISTER or METADATA")

    def on_register(self, reg: msgs.Register, session: Optional[Session] = None) -> None:
        if session is not None:
            owner = self.auth.agent_owner(reg.agent_name)
            if (reg.endpoint, reg.port) != session.peer:
                return self.auth.foreign(session, f"REGISTER names another address ({reg.endpoint}:{reg.port})")
            if owner is not None and owner is not session and owner.peer != session.peer:
                return self.auth.foreign(session, f"REGISTER names agent {reg.agent_name!r}, registered by another peer")
        peer_layout = from_peer(reg.layout)
        rejection = None
        plan = None
        mine = self.adopted.parallel
        try:
            theirs = peer_layout.parallel
            if (reg.attn_tp_size, reg.attn_tp_rank) != (theirs.attn_tp, theirs.attn_rank):
                raise ValueError(f"the message says decode rank {reg.attn_tp_rank}/{reg.attn_tp_size}, its layout "
                                 f"{theirs.attn_rank}/{theirs.attn_tp}")
            if tuple(reg.state_types) != self.adopted.state_types:
                raise ValueError(f"state types {list(self.adopted.state_types)} on the prefill, "
                                 f"{list(reg.state_types)} on the decode; expected the same model")
            plan = plan_peer(self.adopted, peer_layout)
        except ValueError as e:
            rejection = (f"hybridkv cannot pair prefill rank {mine.attn_rank}/{mine.attn_tp} with decode rank "
                         f"{reg.attn_tp_rank}/{reg.attn_tp_size}: {e}")
        kv_mem = next((r.mem for r in peer_layout.memory.regions
                       if any(g.group_id == KV_GROUP and r.region_id in g.region_ids for g in peer_layout.memory.groups)),
                      None)
        region, why = decode_region(peer_layout.memory.regions, kv_mem, reg.staging_region)
        if why:
            logger.warning("hybridkv: decode %s: no staging into its slots: %s", reg.agent_name, why)
        memory = peer_layout.memory if region is None else \
            dataclasses.replace(peer_layout.memory, regions=peer_layout.memory.regions + (region,))
        name = self.dp.add_peer(reg.agent_metadata, memory)
        if name != reg.agent_name:
            if name not in self.peers:
                self.dp.remove_peer(name)
            raise ValueError(f"agent metadata names {name!r} but the message says {reg.agent_name!r}")
        if session is not None:
            if session.agent is not None and session.agent != name:
                # The decode rank at that address restarted with another agent: the old one retires.
                self.retiring.retire(session.agent, f"decode rank {reg.endpoint}:{reg.port} registered another "
                                                  f"NIXL agent ({name}); its previous one is removed")
            session.agent = name
        kv_lists = self._kv_lists(name, plan, peer_layout)
        self.peers[name] = Peer(agent_name=name, layout=peer_layout, planners=plan.planners if plan else {},
                                 plan=plan, rejection=rejection, kv_lists=kv_lists,
                                 staged=self._staged(name, plan, peer_layout, kv_lists, region))
        if rejection:
            logger.error("hybridkv: decode %s refused: %s", name, rejection)
        elif plan is not None and plan.one_sided:
            # SGLang's NIXL backend tolerates these too (check_peer_aux_buffer_count); said once per registration
            logger.warning("hybridkv: decode %s: %s", name, "; ".join(plan.one_sided))

    def _kv_lists(self, name: str, plan: Optional[PeerPlan], peer: AdoptedLayout) -> Optional[PieceLists]:
        """Different attention TP: the agent's KV slices as prepped lists, made at its first REGISTER and kept
        (a chunk in flight may use them; they go when the agent retires). Equal TP posts whole-page runs."""
        old = self.peers.get(name)
        if old is not None and old.kv_lists is not None:
            return old.kv_lists
        if plan is None or self.adopted.parallel.attn_tp == peer.parallel.attn_tp:
            return None
        planner = plan.planners.get(Component(group=GroupId(KV_GROUP), kind=ComponentKind.KV))
        if planner is None:
            return None  # another prefill rank writes every KV field this decode rank holds
        try:
            return sliced_kv(dp=self.dp, agent_name=name, planner=planner, group=KV_GROUP)
        except ValueError as e:  # not page to page, or mixed memory kinds: rows per chunk
            logger.info("hybridkv: decode %s: KV slices posted as rows (%s)", name, e)
            return None

    def _staged(self, name: str, plan: Optional[PeerPlan], peer: AdoptedLayout, kv_lists: Optional[PieceLists],
                region) -> Optional[StagedPeer]:
        """Staging on and KV sliced for this agent: what this rank packs for it (staged_kv.py)."""
        if self.exports.staging is None or kv_lists is None or plan is None:
            return None
        kv = Component(group=GroupId(KV_GROUP), kind=ComponentKind.KV)
        planner = plan.planners.get(kv)
        staged, why = StagedPeer.make(local=self.adopted, peer=peer, src=planner.src, dst=planner.dst,
                                      keys=plan.keys.get(kv, frozenset()), region=region)
        if staged is None:
            logger.warning("hybridkv: decode %s: KV written sliced, not staged: %s", name, why)
        return staged

    def on_metadata(self, md: msgs.Metadata, session: Optional[Session] = None) -> None:
        room = md.room
        if session is not None and not self.auth.may_claim(md, session):
            return
        peer = self.peers.get(md.agent_name)
        if peer is None or peer.rejection:
            return self._refuse(md, peer.rejection if peer else f"decode agent {md.agent_name} never registered")
        if self.rooms.status(room) == KVPoll.Failed:
            # Failed here before this decode rank's METADATA came (SGLang's abort, a refused chunk): told now.
            return self._refuse(md, self.rooms.failure(room) or "the room failed on the prefill")
        infos = self.rooms.claim(room)
        infos[md.agent_name] = md
        if len(infos) == md.required_dst_info_num:
            self.rooms.set_decode_prefix_len(room, next(
                (i.decode_prefix_len for i in infos.values() if i.decode_prefix_len), 0
            ))
            self.rooms.update_status(room, KVPoll.WaitingForInput)

    def _refuse(self, md: msgs.Metadata, reason: str) -> None:
        """A decode rank this rank will never write for the room: it is told Failed and DRAINED now, whether or
        not SGLang has a sender for the room yet (routers send to both servers at once, so METADATA often comes
        first, and SGLang says nothing of a room without a status). The room fails here too: at once if its
        sender exists, else as soon as it is made (`take_refusal`)."""
        room = md.room
        logger.error("hybridkv: room %s refused for decode %s: %s", room, md.agent_name, reason)
        self.auth.release_room(room, frozenset((md.agent_name,)))
        decode = (md.endpoint, md.port)
        self.rooms.send_status([decode], room, KVPoll.Failed, reason)
        drained = msgs.Drained(room=room, prefill_rank=self.rooms.prefill_rank(), generation=md.generation)
        self.rooms.push(md.endpoint, md.port, drained.to_frames(), f"DRAINED for refused room {room}")
        if self.rooms.has_status(room):
            if self.rooms.status(room) != KVPoll.Failed:
                self.drains.fail(room, reason)  # the room's other decode ranks, if any, hear it too
        else:
            self._refused[room] = (reason, time.monotonic())
            while len(self._refused) > _MAX_REFUSED:
                self._refused.popitem(last=False)

    def take_refusal(self, room: int) -> Optional[str]:
        """Why a decode rank of the room was refused before SGLang made its sender (once), or None (also for a
        refusal older than SGLang's bootstrap timeout: that request is over, a room id used again is not it)."""
        got = self._refused.pop(room, None)
        return got[0] if got is not None and time.monotonic() - got[1] < _REFUSAL_TTL_S else None

    def on_abort(self, frames: list[bytes], session: Optional[Session] = None) -> None:
        note = AbortNotification.from_zmq(frames)
        if note is None:
            return
        room = note.room
        if session is not None:
            if note.decode_ip is not None and (note.decode_ip, note.decode_port) != session.peer:
                return self.auth.foreign(session, f"ABORT for room {room} names another address")
            claimed = self.rooms.infos(room)
            if claimed and session.agent not in claimed:
                self.auth.foreign(session, f"ABORT for room {room}, claimed by another decode")
                # Answered as an unknown room is (DRAINED at once), so the answer tells nothing of the room.
                if note.decode_ip is not None:
                    frames = msgs.Drained(room=room, prefill_rank=self.rooms.prefill_rank(), generation=0).to_frames()
                    self.rooms.push(note.decode_ip, note.decode_port, frames, f"DRAINED for room {room}")
                return
        decode = (note.decode_ip, int(note.decode_port)) if note.decode_ip and note.decode_port else None
        if decode is not None and note.generation and self.rooms.generations(room).get(decode) != note.generation:
            # The ABORT of an import this rank does not hold for the room (its METADATA came earlier on the same
            # socket: an earlier request that used the room id, or a refused claim): the room is not touched; that
            # decode rank hears DRAINED for that import once nothing of the room is in flight here.
            logger.info("hybridkv: room %s: ABORT of decode %s:%s's import %s, not the room's claim here; "
                        "answered once drained", room, *decode, note.generation)
            self.drains.wait(room, decode, note.generation)
            self.drains.maybe_send(room)
            return
        if self.rooms.has_status(room) and self.rooms.check_status(room) not in (KVPoll.Success, KVPoll.Failed):
            # (A room failed already keeps its first reason: a decode answers a Failed with this ABORT.)
            self.rooms.record_failure(room, "Aborted by decode-side abort notification.")
            self.rooms.update_status(room, KVPoll.Failed)
        if decode is not None:
            self.drains.wait(room, decode, self.rooms.generations(room).get(decode, 0))
        self.exports.retire_export(room)
        self.drains.maybe_send(room)
