"""No block of a failed import goes back while a write into it can land (fencing rule 5, per writer), through
the transport consumer that the vLLM connector's worker half runs: real producer and consumer processes,
real NIXL (UCX) transfers.

The consumer tracks each posted import in the core's ImportLedger (hybridkv/transport/drains.py): a writer's
Failure is not 'drained', losing the producer fails the request but keeps the import open until the drain
deadline (``transfer_timeout_s``), and a READ NIXL would not abort holds its blocks until it ends. In each
test a write into the consumer's blocks is held (push: the producer's WRITE, posted late by a fake fault;
pull: the consumer's own READ, held by stopping the producer, over UCX's TCP transport) while the producer reports failure, says Bye,
or is killed; the consumer's next user of those pages (the next request, or the request recomputing) writes
its own bytes into them, and they are compared after the late write would have landed.

Run with ``HYBRIDKV_DRAIN_RULE_OFF=1`` to switch the rule off in the consumer (tests/transport/drain_peers.py):
every test here then fails. The last few run the consumer's ledger in this process, without NIXL.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from types import SimpleNamespace

import pytest

from tests.transport import drain_peers
from tests.transport.harness import Proc

REQUEST = ("r1", 200)
DRAIN_S = 3.0  # the consumer's drain deadline in push mode (transfer_timeout_s)
HOLD_S = 1.0  # how long the producer's WRITE is held after it failed (inside the deadline)


def _pair(mode: str, *, policy: str = "FAIL", fault: str | None = None, transfer_timeout_s: float = DRAIN_S,
          abort_refused_fake: bool = False, ucx_tls: str | None = None) -> tuple[Proc, Proc, str]:
    """A producer and a consumer of REQUEST; and the digest of the producer's pages of it."""
    prod = Proc(drain_peers.producer_main, {"mode": mode, "request": REQUEST, "fault": fault, "hold_s": HOLD_S,
                                            "ucx_tls": ucx_tls})
    host, port, _ = prod.expect("addr")
    sent = prod.expect("sent")
    cons = Proc(drain_peers.consumer_main, {"addr": (host, port), "mode": mode, "request": REQUEST,
                                            "policy": policy, "transfer_timeout_s": transfer_timeout_s,
                                            "abort_refused_fake": abort_refused_fake, "ucx_tls": ucx_tls})
    return prod, cons, sent


def _stop(*procs: Proc) -> None:
    for p in procs:
        if p.p.is_alive():
            try:
                p.signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
        p.stop()


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "policy"), [
    pytest.param("failure", "FAIL", id="failure-then-next-request"),
    pytest.param("bye", "RECOMPUTE", id="bye-then-recompute"),
])
def test_push_write_held_past_the_producers_failure_lands_before_the_pages_are_reused_fake_held_write(fault, policy):
    """The producer reports failure (or says Bye: its control side goes, its writer does not) while its WRITE
    is held; the WRITE lands ~1 s later. The consumer must not reuse the pages (next request, or recompute)
    before that: the bytes the next user put there are still there afterwards."""
    prod, cons, sent = _pair("PUSH", policy=policy, fault=fault)
    try:
        cons.expect("about_to_fetch")
        cons.send("go")
        t_held = prod.expect("held")
        outcome, _, _ = prod.expect("results")  # its export ended: the late WRITE completed
        assert outcome == "DONE"
        reused = cons.expect("reused")
        assert reused["outcome"] == ("FAILED" if policy == "FAIL" else "RECOMPUTE"), reused
        assert reused["complete"] and reused["same_blocks"]  # the only blocks free were the import's
        time.sleep(0.3)
        cons.send("check")
        pages = cons.expect("pages")
        assert pages["intact"], f"the failed import's late WRITE overwrote pages reused after it: {reused}"
        assert pages["in_flight"] == 0 and not pages["settling"]
        # Neither given back nor recomputed while the WRITE could land (posted HOLD_S after 'held'), only
        # once it did (its notification, after the data: its bytes were there), well before the deadline.
        assert HOLD_S <= reused["t_result"] - t_held < DRAIN_S, (reused, t_held)
        assert reused["t_reuse"] >= reused["t_result"] and reused["found"] == sent
    finally:
        _stop(prod, cons)


@pytest.mark.slow
def test_push_producer_killed_while_its_write_is_held_keeps_the_pages_until_the_drain_deadline():
    """The producer is killed (SIGKILL) after the consumer's Import reached it, its WRITE not yet done: the
    consumer loses it, fails the request, and keeps the blocks out of reuse until the drain deadline, since
    a write in flight from a lost writer may still land (here none does)."""
    prod, cons, _ = _pair("PUSH", fault="killed")
    try:
        cons.expect("about_to_fetch")
        cons.send("go")
        prod.expect("held")
        t_kill = time.monotonic()
        prod.p.kill()
        prod.p.join(5)
        reused = cons.expect("reused")
        assert reused["outcome"] == "FAILED" and "producer lost" in reused["error"], reused
        assert reused["complete"] and reused["same_blocks"]
        # A killed writer's WRITE never lands, so the pages cannot show it: the time does.
        assert reused["t_reuse"] - t_kill >= DRAIN_S, (reused, t_kill)  # the loss is seen after the kill
        assert "drain deadline" in reused["error"], reused
        cons.send("check")
        pages = cons.expect("pages")
        assert pages["intact"] and pages["in_flight"] == 0
    finally:
        _stop(prod, cons)


@pytest.mark.slow
def test_pull_read_held_and_not_abortable_lands_before_the_pages_are_reused_fake_abort_refused():
    """The consumer's own READ is the writer: held (the producer stopped), past the transfer timeout, and NIXL
    refuses the abort (fake). The request fails at once, but its blocks stay out of reuse until the READ
    ends: resumed, the producer serves the READ into them, and only then does the next request get them."""
    prod, cons, sent = _pair("PULL", transfer_timeout_s=1.0, abort_refused_fake=True, ucx_tls="tcp")
    try:
        cons.expect("about_to_fetch")
        prod.signal(signal.SIGSTOP)
        cons.send("go")
        time.sleep(1.0 + 1.0)  # past the READ's timeout: the import is given up, the READ still held
        if not cons.p.is_alive():
            pytest.fail("consumer died")
        t_resume = time.monotonic()
        prod.signal(signal.SIGCONT)
        prod.expect("results")  # the producer ran again
        reused = cons.expect("reused")
        assert reused["outcome"] == "FAILED" and "quarantined" in reused["error"], reused
        assert reused["complete"] and reused["same_blocks"]
        time.sleep(1.0)
        cons.send("check")
        pages = cons.expect("pages")
        assert pages["intact"], f"the held READ overwrote pages reused after its import failed: {reused}"
        assert pages["in_flight"] == 0 and not pages["settling"]
        assert reused["t_result"] < t_resume  # the request failed while the READ was held ...
        assert reused["t_reuse"] >= t_resume, (reused, t_resume)  # ... its blocks went back after it ended
        assert reused["found"] == sent  # (it did land there)
    finally:
        _stop(prod, cons)



# ------------------------------------------------------------------ the consumer's ledger, in one process
# What the producer's words do to an import, through the consumer's Drains (transport/drains.py) over a real
# scheduler and ledger; only the side around them is a namespace (Drains reads its config, scheduler and
# metrics), so that no NIXL agent is needed.

def _drains(mode: str = "PUSH", drain_s: float = 30.0):
    from hybridkv import wire
    from hybridkv.fencing import PoolLayout, TransferScheduler, attention_component, gdn_components
    from hybridkv.transport.config import TransportConfig
    from hybridkv.transport.drains import Drains
    from hybridkv.transport.metrics import TransferMetrics
    from hybridkv.transport.parts import Part

    sched = TransferScheduler(PoolLayout.separate(num_blocks=(4, 2)))
    comps = (attention_component(0), *gdn_components(1))
    sched.add_request("r", expect=comps)
    sched.allocate("r", 0, 4)
    sched.allocate("r", 1, 1)
    tid = sched.post_import("r", components=comps)
    side = SimpleNamespace(config=TransportConfig(mode=wire.Mode[mode], transfer_timeout_s=drain_s),
                           scheduler=sched, metrics=TransferMetrics())
    if os.environ.get(drain_peers.RULE_OFF_ENV) == "1":
        drain_peers._rule_off()
    drains = Drains(side)
    part = Part(rid="r", peer=None, export=None, token=b"t" * 16)
    imp = drains.open("r", tid, comps, ["prefill-0"], part=part if mode == "PUSH" else None)
    return drains, imp, sched, side


def _done(ok: bool = False, token: bytes = b"t" * 16):
    from hybridkv import wire

    return wire.Done(request_id="r", ok=ok, token=token)


def _failure(token: bytes = b"t" * 16):
    from hybridkv import wire

    return wire.Failure(request_id="r", code=wire.FailureCode.TRANSFER_ERROR, detail="no slot", token=token)


def test_a_producers_failure_is_not_drained_its_done_is():
    drains, imp, sched, side = _drains()
    assert drains.heard("prefill-0", _failure())
    assert not imp.ended.is_set() and sched.transfers_in_flight() == 1
    assert imp.failure == "producer failed the request: no slot"
    sched.abort("r")  # the engine lets go: the blocks stay out of the pool while the import is open
    drains.release(imp, quarantined=5)
    assert drains.settling("r")
    assert sched.free_count(0) == 0 and sched.free_count(1) == 1
    assert drains.heard("prefill-0", _done())  # drained: nothing of its can land any more
    assert imp.ended.is_set() and sched.transfers_in_flight() == 0 and not drains.settling("r")
    sched.take_reusable()
    assert sched.free_count(0) == 4 and sched.free_count(1) == 2
    snap = side.metrics.take()
    assert snap.quarantined_blocks == 5 and snap.released_blocks == 5


def test_a_word_without_the_requests_token_is_ignored():
    drains, imp, sched, _ = _drains()
    assert not drains.heard("prefill-0", _done(token=b"x" * 16))
    assert not drains.heard("prefill-1", _done())  # not its writer
    assert not imp.ended.is_set() and sched.transfers_in_flight() == 1


def test_a_write_that_lands_after_the_import_failed_ends_it_without_its_bytes():
    from hybridkv.fencing import RequestPhase

    drains, imp, sched, _ = _drains()
    drains.lost("prefill-0", "producer lost")
    assert not imp.ended.is_set()  # its writer may outlive its control channel
    assert drains.notified("prefill-0", "r")
    assert imp.ended.is_set() and sched.phase("r") is RequestPhase.FAILED and sched.transfers_in_flight() == 0


def test_a_lost_producers_import_ends_at_the_drain_deadline_not_before():
    drains, imp, sched, _ = _drains(drain_s=0.2)
    drains.lost("prefill-0", "producer lost")
    drains.check_deadline(imp)
    drains.expire()
    assert not imp.ended.is_set() and sched.transfers_in_flight() == 1
    time.sleep(0.25)
    drains.expire()
    assert imp.ended.is_set() and sched.transfers_in_flight() == 0
    asyncio.run(drains.settled("r"))  # at once


def test_pull_a_failed_read_holds_its_blocks_until_it_ends_whatever_the_deadline():
    drains, imp, sched, _ = _drains("PULL", drain_s=0.01)
    drains.fail(imp, "READ not done within its timeout")
    drains.release(imp)
    time.sleep(0.05)
    drains.expire()
    drains.check_deadline(imp)
    assert not imp.ended.is_set() and drains.settling("r")  # NIXL says when the READ ends, not a timer
    drains.drained(imp, "prefill-0")
    assert imp.ended.is_set() and sched.transfers_in_flight() == 0
