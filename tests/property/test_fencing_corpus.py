"""The two-sided fencing machine's fixed corpus: one interleaving of each quarantine path, replayed step by step.

Each entry is the machine's initial draw and a list of rule calls; every invariant runs after each call, then the
teardown. Each catches a family of one-line bugs in hybridkv/fencing (issue 47) that the random search of
``test_fencing_machine.py`` finds only now and then; ``python -m tests.property.mutate`` checks that it does.
With ``--fence-policy none`` every entry must fail.
"""

from __future__ import annotations

import pytest

from hybridkv.fencing.fence import FencePolicy
from tests.property.test_fencing_machine import FencingMachine


CORPUS: dict[str, tuple[dict, list[tuple]]] = {
    # A quarantined producer block (its request's lease lapsed under a read) taken back by a prefix hit; the
    # old read ends: the block stays with its new holder.
    "unpark-a-quarantined-block": (dict(n=1), [
        ("quarantine", 0, True), ("p_unpark", 0, 1), ("land", 0, True)]),
    # A producer block parked under its fence (the request's lease lapsed before its last step ran) taken
    # back by a prefix hit; the step completes: its old heap entry must not free it.
    "unpark-a-fenced-block": (dict(depth=2), [
        ("p_schedule", 1, 0), ("p_schedule", 0, 0), ("p_execute",), ("advance_clock", 3.0), ("advance_clock", 3.0),
        ("p_prefix_hit", 0, 1, 1, 1), ("p_execute",)]),
    # A shared producer block leaves quarantine (its read ends) fenced at its sharer's last step, 4, while the
    # last heap entry is an exported request's, fenced at 3: the block waits for step 4.
    "quarantine-exit-behind-a-lower-fence": (dict(depth=3), [
        ("p_schedule", 1, 0), ("p_execute",), ("d_post", 0, 7, True, 0.5), ("p_prefix_hit", 0, 1, 1, 2),
        ("p_schedule", 1, 0), ("p_schedule", 0, 0), ("p_schedule", 0, 0), ("advance_clock", 3.0),
        ("advance_clock", 3.0), ("p_execute",), ("p_schedule", 0, 0), ("p_abort", 0), ("advance_clock", 3.0),
        ("advance_clock", 3.0), ("land", 0, True), ("p_execute",), ("p_execute",)]),
    # Two writes into one GDN block (conv and ssm state apart); the request is aborted; one write ends: the
    # block waits for the other.
    "quarantine-under-two-writes": (dict(), [
        ("p_schedule", 1, 0), ("p_execute",), ("d_post", 0, 2, False, 0.5), ("d_post", 0, 4, False, 0.5),
        ("d_abort", 0), ("land", 0, True)]),
    # Two writers push one import: writer 1 writes all, writer 0 fails (it may still write), writer 1
    # drains, the clock moves inside the drain deadline, writer 0 writes: only then does the import land.
    "two-writers-one-failed": (dict(n=1, push=1, writers=2), [
        ("w_write", 0, 1, 7), ("w_word", 0, 0, 1), ("w_word", 0, 1, 0), ("give_up", 0), ("advance_clock", 1.0),
        ("w_write", 0, 0, 7)]),
    # The same, the request aborted meanwhile: its blocks wait for writer 0, who writes into them.
    "two-writers-aborted": (dict(n=1, push=1, writers=2), [
        ("w_word", 0, 0, 1), ("w_word", 0, 1, 0), ("d_abort", 0), ("advance_clock", 1.0), ("w_write", 0, 0, 7),
        ("advance_clock", 3.0)]),
    # A request dies with its pull in flight and is admitted again under its id; the dead one's read lands.
    "dead-incarnation-lands": (dict(), [
        ("p_schedule", 1, 0), ("p_execute",), ("d_post", 0, 7, False, 0.5), ("d_abort", 0), ("d_readmit", 0),
        ("land", 0, True)]),
    # A pushed import fails, is released and expires; the id comes back and opens the key again; the dead
    # generation's writer speaks late.
    "dead-generation-speaks": (dict(n=1, push=1), [
        ("w_word", 0, 0, 1), ("d_abort", 0), ("advance_clock", 3.0), ("d_readmit", 0), ("d_schedule", 0),
        ("late_word", 0, 0, 0), ("late_word", 0, 0, 1), ("late_word", 0, 0, 2)]),
    # A decode request aborted before its zeroing step ran (it never joined a step): its blocks wait for it.
    "abort-before-zeroing-ran": (dict(), [
        ("p_schedule", 1, 0), ("p_schedule", 0, 0), ("p_execute",), ("d_schedule", 0), ("d_abort", 0)]),
    # A prefix sharer runs two more steps and is aborted, then the first holder's lease lapses: the block
    # waits for the sharer's last step.
    "sharer-runs-longer": (dict(), [
        ("p_schedule", 1, 0), ("p_execute",), ("p_prefix_hit", 0, 1, 1, 2), ("p_schedule", 0, 0),
        ("p_schedule", 0, 0), ("p_abort", 1), ("advance_clock", 3.0), ("advance_clock", 3.0)]),
    # Two requests aborted at steps 1 and 2, step 2 still pending when step 1 completes.
    "aborts-at-two-fences": (dict(depth=3), [
        ("p_schedule", 1, 0), ("p_schedule", 1, 0), ("p_abort", 0), ("p_schedule", 0, 0), ("p_abort", 0),
        ("p_execute",), ("p_execute",)]),
    # An import fails for one component while another's write runs: no give-up until it ends.
    "give-up-after-a-failure": (dict(), [
        ("p_schedule", 1, 0), ("p_execute",), ("d_post", 0, 1, False, 0.5), ("d_post", 0, 6, False, 0.5),
        ("land", 0, False), ("give_up", 0), ("land", 0, True)]),
}


def replay(name: str, policy: FencePolicy = FencePolicy.FENCED) -> None:
    init, steps = CORPUS[name]
    m = type("FencingMachine_" + policy.name, (FencingMachine,), {"policy": policy})()
    m.set_depth(**{"depth": 1, **init})
    for name_, *args in steps:
        getattr(m, name_)(*args)
        m.consistent()
        m.idle_free_lists()
        m.books()
    m.teardown()


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_fencing_corpus(name: str, fence_policy_name: str) -> None:
    replay(name, FencePolicy(fence_policy_name))
