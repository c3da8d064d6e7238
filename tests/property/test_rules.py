"""Each fencing rule on its own, against the oracle of ``oracle.py``.

One test per rule draws scenarios only from the operations that rule is about (so its examples
are not spent elsewhere), on a pool of six blocks that ``GRAB`` hands out whole: a block freed too
early is handed out again inside the example that freed it, and the oracle says which rule broke.
Every test also replays a fixed corpus (``@example``): scenarios that each catch a plausible
one-line bug in hybridkv/fencing (``python -m tests.property.mutate`` applies them and checks).
With ``--fence-policy none`` these tests must fail.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from hybridkv.fencing.fence import FencePolicy
from tests.property import counter
from tests.property.oracle import (
    ABORT,
    COMPLETE,
    DONE,
    EXPORT,
    FINISH,
    FREE,
    GRAB,
    HEARTBEAT,
    IMPORT,
    LAND,
    NEW,
    RECOMPUTE,
    RENEW,
    SHARE,
    STEP,
    TICK,
    WAIT,
    Oracle,
    Violation,
)

CI = bool(os.environ.get("CI"))
# Per test; the CI run (HYBRIDKV_PROPERTY_EXAMPLES=10000) gives each of the six rule tests a tenth of the
# budget and the two-sided machine two fifths (test_fencing_machine.py): the machine's examples grew dearer
# (quarantine, incarnations, give-up, the import ledger), the suite's CPU time stays below what it was and
# the total above 10,000. 0: the fixed corpus alone (the mutation check's quick mode).
_ASKED = int(os.environ.get("HYBRIDKV_PROPERTY_EXAMPLES", 10_000 if CI else 300))
EXAMPLES = max(50, _ASKED // 10)
# 0: generated examples alone (the mutation check's --generated-only: does the search find each bug?)
_CORPUS = os.environ.get("HYBRIDKV_PROPERTY_CORPUS", "1") != "0"
# The mutation check only asks whether a test fails: it sets 0, and a failure is not shrunk.
_SHRINK = os.environ.get("HYBRIDKV_PROPERTY_SHRINK", "1") != "0"
_PHASES = tuple(p for p in Phase if (p is Phase.explicit and _CORPUS) or (
    p is not Phase.explicit and _ASKED != 0 and (p is not Phase.shrink or _SHRINK)))

i8 = st.integers(min_value=0, max_value=7)
OPS = {
    NEW: st.tuples(st.just(NEW), st.integers(min_value=1, max_value=3), st.booleans()),
    "new_local": st.tuples(st.just(NEW), st.integers(min_value=1, max_value=3), st.just(False)),
    "new_remote": st.tuples(st.just(NEW), st.integers(min_value=1, max_value=3), st.just(True)),
    STEP: st.tuples(st.just(STEP), st.integers(min_value=0, max_value=15)),
    COMPLETE: st.tuples(st.just(COMPLETE)),
    FINISH: st.tuples(st.just(FINISH), i8, st.booleans()),
    "finish_free": st.tuples(st.just(FINISH), i8, st.just(False)),
    "finish_export": st.tuples(st.just(FINISH), i8, st.just(True)),
    FREE: st.tuples(st.just(FREE), i8),
    ABORT: st.tuples(st.just(ABORT), i8),
    IMPORT: st.tuples(st.just(IMPORT), i8, st.integers(min_value=1, max_value=7),
                      st.sampled_from([None, 1.0, 4.0]), st.sampled_from([0.0, 0.5, 2.0])),
    EXPORT: st.tuples(st.just(EXPORT), i8, st.sampled_from([0.0, 0.5, 2.0, 5.0])),
    LAND: st.tuples(st.just(LAND), i8, st.booleans()),
    RENEW: st.tuples(st.just(RENEW), i8),
    HEARTBEAT: st.tuples(st.just(HEARTBEAT), i8),
    DONE: st.tuples(st.just(DONE), i8),
    TICK: st.tuples(st.just(TICK), st.sampled_from([0.5, 1.5, 3.0, 5.0])),
    WAIT: st.tuples(st.just(WAIT), st.sampled_from([0.5, 1.5, 3.0, 5.0])),
    RECOMPUTE: st.tuples(st.just(RECOMPUTE), i8),
    GRAB: st.tuples(st.just(GRAB)),
    SHARE: st.tuples(st.just(SHARE), i8, i8),
}


def scenarios(*names: str):
    # Long enough that the few operations a rule's bug needs, in order, come together often.
    return st.lists(st.one_of([OPS[n] for n in names]), min_size=12, max_size=50)


def rule_settings():
    return settings(max_examples=EXAMPLES, deadline=None,
                    phases=_PHASES,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def policy(fence_policy_name: str) -> FencePolicy:
    return FencePolicy(fence_policy_name)


def check(policy: FencePolicy, ops) -> None:
    counter.add(1)
    Oracle(policy).run(ops)


# Rule 2 (vLLM Race A): a freed block comes back only once no pending step may touch it. A request
# runs at step 0, is freed while step 0 is still on the device: its blocks must wait.
@given(ops=scenarios("new_local", STEP, COMPLETE, "finish_free", FREE, ABORT, GRAB))
@example(ops=[(NEW, 2, False), (STEP, 1), (FINISH, 0, False), (GRAB,)])
@example(ops=[(NEW, 3, False), (STEP, 1), (FREE, 0), (GRAB,)])
@example(ops=[(NEW, 2, False), (STEP, 1), (STEP, 0), (COMPLETE,), (FINISH, 0, False), (GRAB,)])
@example(ops=[(NEW, 1, False), (STEP, 1), (ABORT, 0), (GRAB,)])
@example(ops=[(NEW, 1, False), (STEP, 1), (NEW, 1, False), (STEP, 1), (FINISH, 1, False),
              (FINISH, 0, False), (COMPLETE,), (GRAB,)])
@rule_settings()
def test_rule2_reuse_waits_for_the_watermark(policy: FencePolicy, ops) -> None:
    check(policy, ops)


# Rule 5 (SGLang #24527) on the read side: blocks an outbound read is reading are held until the read
# ends, whatever else releases them (export done, abort, lease expiry).
@given(ops=scenarios("new_local", STEP, COMPLETE, "finish_export", EXPORT, LAND, DONE, ABORT, TICK, GRAB))
@example(ops=[(NEW, 2, False), (FINISH, 0, True), (EXPORT, 0, 0.0), (DONE, 0), (GRAB,)])
@example(ops=[(NEW, 1, False), (FINISH, 0, True), (EXPORT, 0, 0.0), (TICK, 5.0), (GRAB,)])
@example(ops=[(NEW, 1, False), (FINISH, 0, True), (EXPORT, 0, 0.0), (ABORT, 0), (TICK, 5.0), (GRAB,)])
@example(ops=[(NEW, 2, False), (FINISH, 0, True), (EXPORT, 0, 0.0), (EXPORT, 0, 0.0), (LAND, 0, True),
              (DONE, 0), (GRAB,)])
@rule_settings()
def test_rule5_read_in_flight_holds_its_blocks(policy: FencePolicy, ops) -> None:
    check(policy, ops)


# Rule 5 on the write side: an aborted (or finished, or failed) request's blocks stay quarantined while
# an import writes them; rule 3: zeroing a block an import wrote is skipped; rule 4: ready only when all
# components landed.
@given(ops=scenarios("new_remote", STEP, COMPLETE, IMPORT, LAND, ABORT, FINISH, FREE, RECOMPUTE, GRAB))
@example(ops=[(NEW, 1, True), (IMPORT, 0, 7, None, 0.0), (ABORT, 0), (GRAB,)])
@example(ops=[(NEW, 2, True), (STEP, 0), (COMPLETE,), (IMPORT, 0, 7, None, 0.0), (ABORT, 0), (STEP, 0),
              (COMPLETE,), (GRAB,)])
@example(ops=[(NEW, 2, True), (IMPORT, 0, 1, None, 0.0), (FREE, 0), (GRAB,)])
@example(ops=[(NEW, 1, True), (IMPORT, 0, 1, None, 0.0), (LAND, 0, False), (IMPORT, 0, 6, None, 0.0),
              (ABORT, 0), (GRAB,)])
@example(ops=[(NEW, 1, True), (STEP, 0), (IMPORT, 0, 7, None, 0.0)])
@example(ops=[(NEW, 1, True), (IMPORT, 0, 7, None, 0.0), (STEP, 0)])
@example(ops=[(NEW, 1, True), (IMPORT, 0, 7, None, 0.0), (LAND, 0, True), (STEP, 0)])
@example(ops=[(NEW, 1, True), (IMPORT, 0, 1, None, 0.0), (LAND, 0, True)])
@example(ops=[(NEW, 1, True), (IMPORT, 0, 7, None, 0.0), (LAND, 0, False), (RECOMPUTE, 0), (STEP, 1),
              (GRAB,)])
@example(ops=[(NEW, 1, True), (IMPORT, 0, 1, None, 0.0), (LAND, 0, False), (IMPORT, 0, 6, None, 0.0),
              (RECOMPUTE, 0)])
@rule_settings()
def test_rule5_abort_quarantines_imports(policy: FencePolicy, ops) -> None:
    check(policy, ops)


# Rule 7 with rule 5: a block several requests hold goes back only after its last holder, and never while a
# transfer reads or writes it, whoever's transfer that is; no second hold on a block an import writes.
@given(ops=scenarios(NEW, STEP, COMPLETE, SHARE, FINISH, FREE, ABORT, EXPORT, IMPORT, LAND, DONE, TICK, GRAB))
# a's export read outlives a's request (the consumer's Done came first, or the lease lapsed); b, the last
# holder, finishes: the block must wait for the read.
@example(ops=[(NEW, 1, False), (NEW, 1, False), (SHARE, 0, 1), (FINISH, 0, True), (EXPORT, 0, 0.0), (DONE, 0),
              (FINISH, 0, False), (GRAB,)])
@example(ops=[(NEW, 1, False), (NEW, 1, False), (SHARE, 0, 1), (FINISH, 0, True), (EXPORT, 0, 0.0), (TICK, 5.0),
              (FINISH, 0, False), (GRAB,)])
# a block an import writes gets no second holder (the importer's abort, then the holder's release, would free
# it under the write)
@example(ops=[(NEW, 1, True), (NEW, 1, False), (IMPORT, 0, 7, None, 0.0), (SHARE, 0, 0), (ABORT, 0),
              (FINISH, 0, False), (GRAB,)])
# a block quarantined under a read, whose fence a sharer's step raised meanwhile, waits for the watermark too
# once the read ends
@example(ops=[(NEW, 1, False), (NEW, 1, False), (SHARE, 0, 1), (FINISH, 0, True), (EXPORT, 0, 0.0), (STEP, 1),
              (FINISH, 0, False), (DONE, 0), (LAND, 0, True), (GRAB,)])
@rule_settings()
def test_rule7_shared_blocks(policy: FencePolicy, ops) -> None:
    check(policy, ops)


# Rule 6: leases expire (and only then), renew only while live and wanted, bound when a read may start,
# and an import that lands past its lease is not trusted.
@given(ops=scenarios(NEW, STEP, COMPLETE, "finish_export", HEARTBEAT, TICK, WAIT, EXPORT, LAND, ABORT, DONE,
                     IMPORT, RENEW, GRAB))
@example(ops=[(NEW, 1, False), (FINISH, 0, True), (TICK, 5.0), (GRAB,)])
@example(ops=[(NEW, 1, False), (FINISH, 0, True), (WAIT, 5.0), (HEARTBEAT, 0), (TICK, 0.5), (GRAB,)])
@example(ops=[(NEW, 1, False), (FINISH, 0, True), (TICK, 3.0), (HEARTBEAT, 0), (TICK, 3.0), (GRAB,)])
@example(ops=[(NEW, 1, False), (FINISH, 0, True), (ABORT, 0), (HEARTBEAT, 0)])
@example(ops=[(NEW, 1, False), (FINISH, 0, True), (EXPORT, 0, 5.0)])
@example(ops=[(NEW, 1, False), (FINISH, 0, True), (TICK, 3.0), (EXPORT, 0, 2.0)])
@example(ops=[(NEW, 1, True), (IMPORT, 0, 7, 1.0, 0.5), (TICK, 1.5), (LAND, 0, True)])
@example(ops=[(NEW, 1, True), (IMPORT, 0, 7, 1.0, 2.0)])
@example(ops=[(NEW, 1, True), (IMPORT, 0, 7, 1.0, 0.5), (RENEW, 0), (TICK, 1.5), (LAND, 0, True)])
@rule_settings()
def test_rule6_leases(policy: FencePolicy, ops) -> None:
    check(policy, ops)


# Rules 1-6 together, both sides' operations in one pool.
@given(ops=scenarios(*(n for n in OPS if n not in ("new_local", "new_remote", "finish_free", "finish_export"))))
@example(ops=[(NEW, 1, False), (STEP, 1), (FINISH, 0, True), (EXPORT, 0, 0.0)])
@example(ops=[(NEW, 1, False), (STEP, 1), (FINISH, 0, True), (COMPLETE,), (EXPORT, 0, 0.0)])
@example(ops=[(NEW, 1, False), (STEP, 0), (COMPLETE,), (STEP, 1), (FINISH, 0, True), (EXPORT, 0, 0.0)])
@rule_settings()
def test_rules_together(policy: FencePolicy, ops) -> None:
    check(policy, ops)


def test_the_oracle_catches_an_early_free() -> None:
    """The oracle itself: a scheduler without fencing hands out a block under a pending step."""
    with pytest.raises(Violation, match="pending"):
        Oracle(FencePolicy.NONE).run([(NEW, 2, False), (STEP, 1), (FINISH, 0, False), (GRAB,)])
