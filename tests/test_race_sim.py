"""The race simulator: fencing prevents every race class; without it each one corrupts."""

from __future__ import annotations

import json

import pytest

from hybridkv.cli import main
from hybridkv.fencing.fence import FencePolicy
from hybridkv.sims.race import RaceClass, simulate

N = 300


@pytest.mark.parametrize("race", list(RaceClass), ids=lambda r: r.value)
@pytest.mark.parametrize("depth", [1, 3])
def test_fenced_corrupts_nothing(race: RaceClass, depth: int) -> None:
    r = simulate(race, policy=FencePolicy.FENCED, requests=N, seed=1, async_depth=depth)
    assert r.requests == N
    assert r.corrupted == 0 and r.corrupted_any == 0, r.causes


@pytest.mark.parametrize("race", list(RaceClass), ids=lambda r: r.value)
def test_unfenced_each_race_corrupts(race: RaceClass) -> None:
    r = simulate(race, policy=FencePolicy.NONE, requests=N, seed=1, async_depth=2)
    assert r.corrupted > 0, r.causes
    assert r.corrupted <= r.corrupted_any <= N


def test_free_reuse_needs_async_scheduling() -> None:
    # Race A is a race against steps already dispatched: none at depth 0.
    r = simulate(RaceClass.FREE_REUSE, policy=FencePolicy.NONE, requests=N, seed=1, async_depth=0)
    assert r.corrupted == 0


def test_abort_scenario_aborts_and_still_drains() -> None:
    r = simulate(RaceClass.ABORT_REUSE, policy=FencePolicy.FENCED, requests=N, seed=2, async_depth=2)
    assert r.aborted > 0 and r.corrupted_any == 0


def test_stuck_writers_abort_give_up_and_come_back_and_still_drain() -> None:
    # Failed imports are aborted (the id comes back: a new incarnation) or given up (recompute) while
    # stuck writers still write; fenced, nothing is corrupted and every block comes back (checked inside).
    r = simulate(RaceClass.STUCK_WRITERS, policy=FencePolicy.FENCED, requests=N, seed=2, async_depth=2)
    assert r.aborted > 0 and r.corrupted_any == 0, r.causes


def test_deterministic_for_a_seed() -> None:
    a = simulate(RaceClass.ZEROING, policy=FencePolicy.NONE, requests=100, seed=7, async_depth=1)
    b = simulate(RaceClass.ZEROING, policy=FencePolicy.NONE, requests=100, seed=7, async_depth=1)
    assert a == b


def test_cli_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "race", "--policy", "none", "--requests", "100", "--seed", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["races"]) == {"free-reuse", "zeroing", "abort-reuse", "partial-state", "stuck-writers"}
    for v in doc["races"].values():
        assert v["requests"] == 100 and isinstance(v["corrupted"], int)


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "race", "--requests", "50", "--async-depth", "2"]) == 0
    out = capsys.readouterr().out
    for race in RaceClass:
        assert race.value in out


def test_cli_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "race", "--requests", "0"]) == 2
    assert "--requests 0" in capsys.readouterr().err
