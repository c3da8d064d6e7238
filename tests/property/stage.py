"""Model sides for the staging machine (``test_staging_machine.py``): the real slot bookkeeping, no NIXL.

The producer is the transport's own :class:`~hybridkv.transport.exports.Exports` over a real
:class:`~hybridkv.transport.staging.StagePool` and :class:`~hybridkv.fencing.scheduler.TransferScheduler`;
each consumer runs the real :meth:`Importer._pull_parts <hybridkv.transport.fetch.Importer>` (its slot
taken at post, unpacked once every READ ended, given back when its READ ended) over a pool of its own.
What is modelled, and named so here:

* the data plane (a fake: NIXL cannot be made to stall, lose or refuse an abort at will): a posted READ
  is a :class:`Read` that copies its plan's rows, byte for byte, **when it lands** (any moment the machine
  picks, the latest an RDMA READ may read its source), writes garbage into its first row when it fails,
  and may refuse an abort (it then lands, or fails, later);
* the control channels (fakes): messages queue until the machine delivers them, in order per peer;
* the stager (a model of ``descriptors.staging.StagePlan``): one group of whole pages, packed back to back.

Memory is real host memory: page ``b`` of a producer request holds a tag of (request, index) in every
byte range, so a read of a reused slot lands another request's tag and the consumer's content check
says whose.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from hybridkv import wire
from hybridkv.errors import PeerLost
from hybridkv.fencing.fence import FencePolicy, PoolLayout
from hybridkv.fencing.request_state import Component, ComponentKind
from hybridkv.fencing.scheduler import TransferScheduler
from hybridkv.transport.config import Stats, TransportConfig
from hybridkv.transport.dataplane import DataPlaneConfig, XferState
from hybridkv.transport.drains import Drains
from hybridkv.transport.exports import Exports
from hybridkv.transport.fetch import Importer, Work
from hybridkv.transport.memory import MemoryMap
from hybridkv.transport.metrics import TransferMetrics
from hybridkv.transport.parts import Parts
from hybridkv.transport.plan import TransferPlan
from hybridkv.transport.side import Peer
from hybridkv.transport.staging import CopyStep, Place, Slot, StagePool, StagingConfig, StagingMode

KV = Component(group=0, kind=ComponentKind.KV)
PAGE = 64  # bytes of a page; a request's slot is one pool unit per page
P_BLOCKS = 8
D_BLOCKS = 6
P_UNITS = 3  # small pools: slots are reused inside an example, and a full pool falls back
D_UNITS = 4
LEASE_S = 4.0
GARBAGE = 0xEE


class Violation(AssertionError):
    """A slot was reused while a read of it may run: a request received bytes that are not its own."""


def tag(uid: int, i: int) -> np.ndarray:
    """The bytes of page ``i`` of request ``uid``: its number and index, repeated."""
    return np.frombuffer(np.array([uid, i], dtype=np.int32).tobytes() * (PAGE // 8), dtype=np.uint8)


def owner(page: np.ndarray) -> tuple[int, int] | str:
    """Whose tag a page holds (request, index), or what else it holds."""
    head = page[:8].view(np.int32)
    whole = tag(int(head[0]), int(head[1]))
    if np.array_equal(page, whole):
        return int(head[0]), int(head[1])
    return "garbage" if (page == GARBAGE).any() else "a mix"


def _memory(buf: np.ndarray, pages: int) -> MemoryMap:
    region = wire.RegionInfo(region_id=0, base_addr=int(buf.ctypes.data), stride=PAGE, page_bytes=PAGE,
                             num_pages=pages, mem=wire.Mem.DRAM, device_id=0)
    return MemoryMap(regions=(region,), groups=(wire.GroupInfo(group_id=0, region_ids=(0,)),))


def _view(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


def _rows(src: list[tuple[int, int]], dst: list[tuple[int, int]]) -> TransferPlan:
    s = np.array([[a, n, 0] for a, n in src], dtype=np.int64).reshape(-1, 3)
    d = np.array([[a, n, 0] for a, n in dst], dtype=np.int64).reshape(-1, 3)
    z = np.zeros(len(src), dtype=np.int64)
    return TransferPlan(src=s, dst=d, src_region=z, dst_region=z.copy())


class PageStager:
    """A model of ``descriptors.staging.StagePlan`` for one group of whole pages: a request's pages
    back to back in the slot. The sliced plan it stands in for reads each page in two halves (two
    head slices), so a staged read always posts fewer descriptors."""

    def __init__(self, producer: MemoryMap, consumer: MemoryMap) -> None:
        self._dst_base = consumer.regions[0].base_addr

    def nbytes(self, src_blocks) -> int:
        return len(src_blocks[0]) * PAGE

    def pack(self, src_blocks, *, base: int = 0) -> list[CopyStep]:
        b = np.asarray(src_blocks[0], dtype=np.int64)
        return [CopyStep(src=Place(region=0, offset=0, stride=PAGE), dst=Place(region=None, offset=base, stride=PAGE),
                         src_pages=b, dst_pages=np.arange(b.size, dtype=np.int64), length=PAGE)]

    def read(self, slot_addr: int, slot_dev: int, src_blocks, dst_blocks) -> TransferPlan:
        d = [int(x) for x in dst_blocks[0]]
        return _rows([(slot_addr + i * PAGE, PAGE) for i in range(len(d))],
                     [(self._dst_base + k * PAGE, PAGE) for k in d])

    def unpack(self, src_blocks, dst_blocks, *, base: int = 0) -> list[CopyStep]:
        d = np.asarray(dst_blocks[0], dtype=np.int64)
        return [CopyStep(src=Place(region=None, offset=base, stride=PAGE), dst=Place(region=0, offset=0, stride=PAGE),
                         src_pages=np.arange(d.size, dtype=np.int64), dst_pages=d, length=PAGE)]


class Planned:
    """The consumer's planner prepared for the one producer: the sliced plan (two rows a page) and the stager."""

    def __init__(self, producer: MemoryMap, consumer: MemoryMap) -> None:
        self._src, self._dst = producer.regions[0].base_addr, consumer.regions[0].base_addr
        self._stager = PageStager(producer, consumer)

    def plan(self, source: int, theirs, mine) -> TransferPlan:
        h = PAGE // 2
        pairs = [(int(s), int(d)) for s, d in zip(theirs[0], mine[0])]
        return _rows([(self._src + s * PAGE + j * h, h) for s, _ in pairs for j in (0, 1)],
                     [(self._dst + d * PAGE + j * h, h) for _, d in pairs for j in (0, 1)])

    def stager(self, source: int) -> PageStager:
        return self._stager


class Channel:
    """A control channel (fake): what is sent waits in ``queue`` for the machine to deliver it."""

    def __init__(self) -> None:
        self.queue: deque = deque()
        self.broken = False
        self.sealer = None
        self.peer = None

    async def send(self, msg: wire.Message) -> None:
        if self.broken:
            raise PeerLost("channel closed")
        self.queue.append(msg)

    async def close(self) -> None:
        self.broken = True


@dataclass(eq=False)
class Read:
    """A posted READ (the data plane's transfer, modelled): its plan's rows copy when it lands."""

    uid: str
    consumer: int
    plan: TransferPlan
    work: Work
    state: XferState = XferState.IN_PROGRESS
    abortable: bool = True  # NIXL may refuse to abort a READ (it then ends when it ends)
    waiter: asyncio.Future | None = None
    nbytes: int = 0

    def copy(self) -> None:
        for (sa, n, _), (da, _, _) in zip(self.plan.src.tolist(), self.plan.dst.tolist()):
            _view(da, n)[:] = _view(sa, n)

    def garbage(self) -> None:
        da, n, _ = self.plan.dst[0].tolist()
        _view(da, n)[: max(1, n // 2)] = GARBAGE


class DataPlane:
    """The consumer's data plane (fake): READs end when the machine says."""

    def __init__(self) -> None:
        self.reads: list[Read] = []

    def release(self, x: Read) -> None:
        pass

    def abort(self, x: Read) -> bool:
        if not x.abortable:
            return False
        x.state = XferState.ERROR  # aborted: nothing more lands from it
        return True

    def state(self, x: Read) -> XferState:
        return x.state


def _side(memory: MemoryMap, sched: TransferScheduler, config: TransportConfig, planner, dp) -> SimpleNamespace:
    """What Exports / Importer / Drains read of a transport Side (the real one builds a NIXL agent)."""
    return SimpleNamespace(memory=memory, scheduler=sched, config=config, planner=planner, dp=dp, peers={},
                           stats=Stats(), metrics=TransferMetrics(), closing=False,
                           drop_agent=lambda agent: None, spin_up=lambda: None, spin_down=lambda: None)


def _config() -> TransportConfig:
    # pump_idle_s 0: the pauses of the real code (waiting for a fence, polling a READ that would not abort)
    # yield to the loop without sleeping, so the machine's loop steps move them.
    return TransportConfig(mode=wire.Mode.PULL, pump_idle_s=0.0, dataplane=DataPlaneConfig(telemetry=False))


def staging_config(policy: FencePolicy, units: int, fence: bool | None = None) -> StagingConfig:
    # ON: stage every read a slot holds; direct_rows 1: a one-page read goes straight into the pages,
    # a longer one through a slot of the consumer's. Under the fence policy NONE the slot fence is off too;
    # otherwise it is ``fence`` where given, else the environment's (HYBRIDKV_STAGING_RULE_OFF).
    on = policy is FencePolicy.FENCED and (fence is None or fence)
    kw = {} if on and fence is None else {"fence": on}
    return StagingConfig(mode=StagingMode.ON, capacity_bytes=units * PAGE, slot_bytes=PAGE, direct_rows=1, **kw)


class ProducerSide:
    def __init__(self, policy: FencePolicy, clock, fence: bool | None = None) -> None:
        self.buf = np.zeros(P_BLOCKS * PAGE, dtype=np.uint8)
        self.sched = TransferScheduler(PoolLayout.shared(num_blocks=P_BLOCKS, num_groups=1), policy=policy,
                                       lease_s=LEASE_S, clock=clock)
        self.pool = StagePool(_memory(self.buf, P_BLOCKS), staging_config(policy, P_UNITS, fence))
        planner = SimpleNamespace(stager=PageStager)
        self.side = _side(self.pool.memory, self.sched, _config(), planner, None)
        self.exports = Exports(self.side, self.pool)
        self.channel = Channel()  # consumers -> this side: (peer as this side knows it, message)


@dataclass(eq=False)
class Import:
    """One consumer's import of one request, as the machine follows it."""

    uid: str
    num: int
    token: bytes
    mine: dict
    export: wire.Export | None = None
    own_slot: bool = False
    done: bool = False
    task: asyncio.Task | None = None
    part: object = None
    slot: Slot | None = None  # the producer's slot the Export named, as the producer's pool holds it
    stage: tuple = ()
    deadline: float = float("inf")
    result: object = None


class ConsumerSide:
    def __init__(self, index: int, policy: FencePolicy, clock, producer: ProducerSide) -> None:
        self.index = index
        self.buf = np.zeros(D_BLOCKS * PAGE, dtype=np.uint8)
        memory = _memory(self.buf, D_BLOCKS)
        self.sched = TransferScheduler(PoolLayout.shared(num_blocks=D_BLOCKS, num_groups=1), policy=policy,
                                       lease_s=LEASE_S, clock=clock)
        cfg = staging_config(policy, D_UNITS)
        self.pool = StagePool(memory, cfg)
        self.memory = self.pool.memory
        self.dp = DataPlane()
        self.side = _side(self.memory, self.sched, _config(), None, self.dp)
        self.planned = Planned(producer.pool.memory, self.memory)
        self.importer = Importer(self.side, Parts(), want=None, prepared=lambda agents: self.planned, lost=None,
                                 post=self._post, wait=self._wait, drains=Drains(self.side), staging=cfg,
                                 pool=self.pool)
        self.inbox = Channel()  # producer -> this side
        self.gen = 0
        self.imports: dict[str, Import] = {}
        self.ended: list[Import] = []
        self.connect(producer)

    def connect(self, producer: ProducerSide) -> None:
        """A (new) session with the producer: its view of us, ours of it."""
        self.gen += 1
        self.agent = f"D{self.index}.{self.gen}"
        self.inbox = Channel()
        self.at_producer = Peer(agent=self.agent, channel=self.inbox, memory=self.memory, lease_s=LEASE_S)
        producer.side.peers[self.agent] = self.at_producer
        self.to_producer = Channel()
        self.producer = Peer(agent="P", channel=self.to_producer, memory=producer.pool.memory, lease_s=LEASE_S)

    def _post(self, w, notif: bytes) -> Read:
        x = Read(uid=w.part.rid, consumer=self.index, plan=w.plan, work=w)
        self.dp.reads.append(x)
        return x

    async def _wait(self, x: Read, until) -> XferState:
        if x.state is not XferState.IN_PROGRESS:
            return x.state
        x.waiter = asyncio.get_running_loop().create_future()
        return await x.waiter


__all__ = ["ConsumerSide", "Import", "KV", "LEASE_S", "PAGE", "ProducerSide", "Read", "Violation", "owner", "tag"]
