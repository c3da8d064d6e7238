"""A staging producer packs only the fields its reader reads from it (wire.Want.fields, protocol 5).

Where the TP exceeds the KV heads, several prefill ranks hold the same replicated head and the decode rank's
planner reads it from one (descriptors/compiler.py ``plan_sources``). Its Want names the fields it reads from each
producer (a mask over the fields the pair shares, descriptors/staging.py ``field_mask``), so the others pack their
other fields only. In one process: the mask's encoding, refusals and the stagers both sides build from it. Between
processes (P4 -> D1, one KV head: ranks 1-3 hold it too; real NIXL, DRAM): every field lands equal to its
producer's, each Export's slot is the asked fields' bytes (ranks 1-3: fewer than every field's), and a Want whose
mask names a field past the pair's is refused with a Failure naming it while the producer serves on, as is a
fifth distinct mask from one consumer (each new mask costs the producer a stager build).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from hybridkv import wire
from hybridkv.transport.staging import BadFieldMask
from tests.transport import hetero_peers
from tests.transport.peers import SECRET, _await_inbox, build, components, run_peer, token

ONE_HEAD_4 = {"num_k_heads": 4, "num_v_heads": 4}  # the test geometry's one KV head, GDN heads TP 4 splits
BLOCK = 48


def _pair(p_tp: int, geo=None):
    """(consumer layout and memory, the producers' layouts and memories, the consumer's planner) for P p_tp -> D1."""
    from hybridkv.descriptors.planning import DescriptorPlanner

    layout, memory, _ = build(50, tp=1, rank=0, block=BLOCK, geo_over=geo)
    prods = [build(10 + r, tp=p_tp, rank=r, block=BLOCK, geo_over=geo)[:2] for r in range(p_tp)]
    return layout, memory, prods, DescriptorPlanner().prepare(tuple(m for _, m in prods), memory)


def test_mask_round_trip_and_refusals():
    from hybridkv.descriptors.staging import field_mask, masked_keys

    order = [("k", i) for i in range(13)]
    keys = {order[0], order[9], order[12]}
    mask = field_mask(order, keys)
    assert mask == bytes([0b1, 0b10010]) and masked_keys(order, mask) == keys
    assert field_mask(order, order) == b"" and masked_keys(order, b"") == frozenset(order)  # every field
    with pytest.raises(BadFieldMask, match="names field 15; expected fields 0..12"):
        masked_keys(order, b"\x01\x80")
    with pytest.raises(BadFieldMask, match="mask of 3 bytes; expected 2 for the 13 fields"):
        masked_keys(order, b"\x01\x00\x00")
    with pytest.raises(BadFieldMask, match="names no field"):
        masked_keys(order, b"\x00\x00")
    with pytest.raises(ValueError, match="does not share"):
        field_mask(order, {("k", 13)})


def test_wire_round_trips_a_mask_and_refuses_one_not_bytes_or_too_long():
    import msgpack

    want = wire.Want(request_id="r1", token=bytes(16), stage=True, fields=b"\xfe\x01")
    assert wire.decode(wire.encode(want)) == want
    for fields, why in ((b"\x01" * (wire.MAX_STAGE_MASK + 1), "at most"), ([1, 2], "expected bytes")):
        msg = msgpack.unpackb(wire.encode(want), raw=False)
        msg["b"]["fields"] = fields
        with pytest.raises(wire.WireError, match=why):
            wire.decode(msgpack.packb(msg, use_bin_type=True))


def test_both_sides_stage_the_fields_the_consumer_reads():
    """P4 -> D1 with one KV head: the decode rank reads it from rank 0, so ranks 1-3 are asked for their GDN
    fields only; the producer's stager for that mask packs exactly the consumer's compact pages (bytes and
    keys), and the mask for every field (a Want without one) still gives the old, larger slot."""
    from hybridkv.descriptors.planning import DescriptorPlanner

    layout, memory, prods, planned = _pair(4, ONE_HEAD_4)
    blocks = {g: np.arange(1, 1 + n) for g, n in hetero_peers._counts(layout, 450).items()}
    for i, (_, src_memory) in enumerate(prods):
        mine = planned.stager(i)
        every = planned.stager(i, b"")
        theirs = DescriptorPlanner().stager(src_memory, memory, mine.fields)
        assert theirs.keys == mine.keys == mine.reads == planned.sources[i]
        assert theirs.nbytes(blocks) == mine.nbytes(blocks)
        assert theirs.page_bytes == mine.page_bytes
        if i == 0:
            assert mine.fields == b"" and mine.nbytes(blocks) == every.nbytes(blocks)
        else:
            assert mine.fields and mine.nbytes(blocks) * 5 < every.nbytes(blocks), (i, mine.nbytes(blocks))
            assert every.reads == mine.reads and every.keys > mine.keys


# ------------------------------------------------------------------------------------------ between processes
REQUESTS = [("f1", 300), ("f2", 150)]


def consumer_main(opts, out, inbox) -> None:
    run_peer(_consumer, opts, out, inbox)


async def _consumer(opts, out, inbox):
    """hetero_peers' decode rank, staged (ON), which first sends producer rank 1 a Want whose mask names a
    field past the pair's, and records each Export's slot against the stagers' bytes."""
    from hybridkv.descriptors.planning import DescriptorPlanner
    from hybridkv.fencing.scheduler import TransferScheduler
    from hybridkv.transport.endpoint import Consumer, Pairing, TransportConfig
    from hybridkv.transport.memory import from_layout

    layout, pools = hetero_peers._layout(opts, 50)
    sched = TransferScheduler(pools, lease_s=30.0)
    cons = Consumer(from_layout(layout), sched, TransportConfig(secret=SECRET, insecure_host_memory=True),
                    planner=DescriptorPlanner(pairing=Pairing.FIELDS), staging=hetero_peers._staging(opts))
    agents = [await cons.connect(host, port) for host, port in opts["addrs"]]
    plan = cons.prepared(agents)
    # a mask of the right length naming its last bit: past the pair's fields (13 here)
    shared = len(plan.stager(1, b"").keys)
    bad = bytes(-(-shared // 8) - 1) + b"\x80"
    await cons.want("bad", token=token("bad"), peer=agents[1], stage=True, fields=bad)
    out.put(("refused", (await _refusal(cons, agents[1], "bad"), 8 * len(bad) - 1, shared)))

    slots: dict = {}
    staged_work = cons._importer._staging.staged_work

    def recording(part, export, theirs, mine, planned, source, sliced):
        slots.setdefault(part.rid, {})[source] = (export.stage[1] if export.stage else None,
                                                  planned.stager(source).nbytes(theirs),
                                                  planned.stager(source, b"").nbytes(theirs))
        return staged_work(part, export, theirs, mine, planned, source, sliced)

    cons._importer._staging.staged_work = recording
    comps = components(layout)
    for rid, _ in opts["requests"]:
        sched.add_request(rid, expect=comps)
    plans = hetero_peers._scattered(sched, layout, opts["requests"])
    results = [await cons.fetch(rid, comps, token=token(rid), peers=agents) for rid in plans]
    sched.audit()
    out.put(("results", [(r.request_id, r.outcome.name, r.error) for r in results]))

    # Rank 1 now holds one mask's stager for this consumer; three other valid masks are taken (their Wants wait
    # for exports that never come), and a fifth is refused rather than built (a stager per Want is ms of CPU).
    mine = plan.stager(1).fields
    others = [m for m in (bytes([1 << i]) + bytes(len(mine) - 1) for i in range(8)) if m != mine][:4]
    for i, mask in enumerate(others):
        await cons.want(f"cycle{i}", token=token(f"cycle{i}"), peer=agents[1], stage=True, fields=mask)
    cycled = await _refusal(cons, agents[1], "cycle3")
    for i in range(len(others) - 1):
        cons._parts.pop(agents[1], f"cycle{i}")
    out.put(("cycled", (cycled, others[3].hex())))
    out.put(("slots", slots))
    out.put(("fields", {rid: hetero_peers.field_digests(layout, plans[rid], t) for rid, t in opts["requests"]}))
    out.put(("sources", {r: sorted(f"{k[0].value}/{k[1]}/{k[2]}" for k in keys) for r, keys in plan.sources.items()}))
    out.put(("state", {"phases": {rid: sched.phase(rid).name for rid in plans}, "staging": cons.staging.describe()}))
    await _await_inbox(inbox, "stop", cons)
    await cons.close()


async def _refusal(cons, agent: str, rid: str) -> str | None:
    """The Failure text that answered the Want of ``rid`` sent to ``agent``, or None where an Export came."""
    from hybridkv.errors import PeerError

    part = cons._parts.get(agent, rid)
    try:
        await asyncio.wait_for(asyncio.shield(part.export), 30)
        return None
    except PeerError as exc:
        return str(exc)
    finally:
        cons._parts.pop(agent, rid)


@pytest.mark.slow
def test_producers_pack_only_the_fields_read_and_refuse_a_bad_mask():
    from tests.transport.harness import Proc

    opts = {"block": BLOCK, "requests": REQUESTS, "geo": ONE_HEAD_4, "staging": {"mode": "on"}, "scatter": True,
            "readers": 1}
    prods = [Proc(hetero_peers.producer_main, {"tp": 4, "rank": r, **opts}) for r in range(4)]
    cons = None
    try:
        addrs = [p.expect("addr") for p in prods]
        cons = Proc(consumer_main, {"tp": 1, "rank": 0, "addrs": addrs, **opts})
        refused, bit, shared = cons.expect("refused")
        assert refused is not None and f"names field {bit}; expected fields 0..{shared - 1}" in refused, refused
        assert [r[1] for r in cons.expect("results")] == ["READY"] * len(REQUESTS)  # served on after the refusal
        cycled, mask = cons.expect("cycled")
        assert cycled is not None and f"stage field mask {mask}: this consumer named 4 others" in cycled, cycled
        slots = cons.expect("slots")
        for rid, _ in REQUESTS:
            got = slots[rid]
            assert sorted(got) == [0, 1, 2, 3], got  # every producer staged (ON)
            for source, (nbytes, asked, every) in got.items():
                assert nbytes == asked, (rid, source, got)  # the Export's slot: the asked fields' bytes
                if source:  # the KV head read from rank 0: the others pack their GDN fields alone
                    assert nbytes < every, (rid, source, got)
                else:
                    assert nbytes == every
        sent = [p.expect("fields") for p in prods]
        got = cons.expect("fields")
        owner = {key: rank for rank, keys in cons.expect("sources").items() for key in keys}
        bad = [(rid, key) for rid, _ in REQUESTS for key, digest in got[rid].items()
               if digest != sent[owner[key]][rid][key]]
        assert not bad and set(owner) == set(got[REQUESTS[0][0]]), bad
        state = cons.expect("state")
        assert set(state["phases"].values()) == {"READY"} and state["staging"]["free"] == state["staging"]["units"]
        for p in prods:  # each producer's exports ended DONE, its blocks and slots back
            assert [r[1] for r in p.expect("results")] == ["DONE"] * len(REQUESTS)
            st = p.expect("state")
            assert st["free"] == st["total"] and st["staging"]["free"] == st["staging"]["units"], st
            assert st["staging"]["taken"] == len(REQUESTS)
    finally:
        for p in prods + ([cons] if cons is not None else []):
            p.stop()
