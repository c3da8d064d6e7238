"""The import ledger (hybridkv/fencing/imports.py): an inbound import is terminal only when every writer drained
or the drain deadline passed; a writer's failure, or a lost node, never releases a block while a write can land."""

from __future__ import annotations

import pytest

from hybridkv.fencing.fence import PoolLayout
from hybridkv.fencing.imports import ImportLedger, ImportState
from hybridkv.fencing.request_state import attention_component, gdn_components
from hybridkv.fencing.scheduler import TransferScheduler

KV = attention_component(0)
CONV, SSM = gdn_components(1)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _setup(writers: int = 2, drain_s: float = 5.0):
    """An engine-owned pool (as SGLang's decode): blocks 0-1 of group 0, slot 0 of group 1, imported by
    ``writers`` writers."""
    clock = Clock()
    s = TransferScheduler(PoolLayout.separate(num_blocks=(4, 2)), managed_pool=False, clock=clock)
    led = ImportLedger(s, drain_timeout_s=drain_s, clock=clock)
    s.add_request("r", expect=(KV, CONV, SSM))
    s.assign("r", 0, [0, 1])
    s.assign("r", 1, [0])
    tids = {c: s.post_import("r", components=[c]) for c in (KV, CONV, SSM)}
    gen = led.open("room", request="r", tids=tids, writers=writers)
    return s, led, clock, gen


def _abort(s: TransferScheduler, led: ImportLedger) -> None:
    """The engine gives the request up: its blocks go back, the entry is released."""
    s.abort("r")
    led.release("room")


def test_lands_only_when_every_writer_wrote_each_component() -> None:
    s, led, _, _ = _setup()
    assert led.landed("room", 0, [KV, CONV, SSM]) == []
    assert s.transfers_in_flight() == 3
    assert led.landed("room", 1, [KV]) == [KV]
    assert led.landed("room", 1, [CONV, SSM]) == [CONV, SSM]
    assert led.state("room") is ImportState.LANDED and s.is_ready("r")
    s.audit()


def test_a_writers_failure_is_not_drained_the_blocks_stay_out_of_reuse_until_it_drains() -> None:
    s, led, clock, _ = _setup()
    led.writer_failed("room", 0, "refused the last chunk")
    led.drained("room", 1)
    _abort(s, led)
    clock.now = 4.0
    assert led.expire() == []
    assert s.transfers_in_flight() == 3 and s.take_reusable() == []  # writer 0 may still be writing
    assert led.drained("room", 0)  # now it said so
    assert "room" not in led  # released and terminal: gone
    assert sorted(s.take_reusable()) == [(0, 0), (0, 1), (1, 0)]
    s.audit()


def test_a_lost_node_fails_the_import_and_keeps_it_open_until_the_deadline() -> None:
    s, led, clock, _ = _setup(writers=1, drain_s=5.0)
    clock.now = 1.0
    led.fail("room", "lost the prefill's bootstrap server")
    _abort(s, led)
    clock.now = 5.9
    assert led.expire() == [] and s.take_reusable() == []
    clock.now = 6.0
    assert led.expire() == ["room"]
    assert sorted(s.take_reusable()) == [(0, 0), (0, 1), (1, 0)]
    s.audit()


def test_with_the_rule_off_a_failure_frees_the_pages_at_once_the_race() -> None:
    """The rule switched off (a failure read as drained, as decode_side.py did): the blocks are reusable while
    writer 0's WRITE may still land. The ledger's answer for the same events is above."""
    s, led, _, _ = _setup()
    led.writer_failed("room", 0, "refused")
    led.drained("room", 1)
    led.drained("room", 0)  # the old rule: a terminal status taken as drained
    _abort(s, led)
    assert s.take_reusable() != []


def test_a_message_of_another_generation_is_ignored() -> None:
    s, led, _, gen = _setup(writers=1)
    _abort(s, led)
    assert not led.drained("room", 0, generation=gen + 1)
    assert led.landed("room", 0, [KV], generation=gen + 1) == []
    assert led.in_flight("room") == 3
    assert led.drained("room", 0, generation=gen)
    assert "room" not in led


def test_a_reused_key_gets_a_new_generation_and_the_old_drained_does_not_settle_it() -> None:
    s, led, _, gen = _setup(writers=1)
    assert led.landed("room", 0, [KV, CONV, SSM], generation=gen) == [KV, CONV, SSM]
    s.request_finished("r")
    led.release("room")
    s.add_request("r2", expect=(KV,))
    s.assign("r2", 0, [2])
    gen2 = led.open("room", request="r2", tids={KV: s.post_import("r2", components=[KV])}, writers=1)
    assert gen2 != gen
    assert not led.drained("room", 0, generation=gen)  # the old request's late DRAINED
    assert led.in_flight("room") == 1


def test_settle_and_unknown_keys() -> None:
    s, led, _, _ = _setup()
    assert led.settle("room", "nothing was published")
    assert led.state("room") is ImportState.SETTLED and led.missing("room") == [KV, CONV, SSM]
    assert not led.settle("room", "again")
    assert not led.drained("nope", 0) and led.landed("nope", 0, [KV]) == [] and not led.fail("nope", "x")
    with pytest.raises(ValueError, match="expected a key whose previous import ended and was released"):
        led.open("room", request="r", tids={}, writers=1)
    with pytest.raises(ValueError, match="writers = 0"):
        led.open("other", request="r", tids={}, writers=0)
    with pytest.raises(ValueError, match="drain_timeout_s"):
        ImportLedger(s, drain_timeout_s=0)
