"""Reports how many interleavings the property suite generated and the seed it drew them from, and holds
the CI budget to its floor.

scripts/test.sh (the README's test command, which .ci/run runs) sets HYBRIDKV_PROPERTY_MIN=10000:
a run of the property suite that generated fewer interleavings then fails instead of passing quietly.

Every run draws fresh examples from a new seed (besides the fixed @example corpus), printed at the
start and the end of the run; ``HYBRIDKV_PROPERTY_SEED=N`` (or hypothesis's ``--hypothesis-seed=N``)
replays a run.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import core

from tests.property import counter

_SEED: list[int] = []


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("hypothesis_seed", None) is not None:
        return  # hypothesis's own option set the seed
    seed = int(os.environ.get("HYBRIDKV_PROPERTY_SEED") or random.SystemRandom().randrange(1 << 32))
    _SEED.append(seed)
    # What --hypothesis-seed sets: every hypothesis test of the run draws from this seed.
    core.global_force_seed = seed


def pytest_report_header(config: pytest.Config) -> str | None:
    return f"hybridkv property tests: seed {_SEED[0]}" if _SEED else None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if counter.total():
        seed = f"seed {_SEED[0]}, HYBRIDKV_PROPERTY_SEED={_SEED[0]} replays it" if _SEED else "seed from --hypothesis-seed"
        terminalreporter.write_line(
            f"hybridkv property tests: {counter.total()} generated interleavings "
            f"(fence policy: {terminalreporter.config.getoption('--fence-policy')}; {seed})"
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    floor = int(os.environ.get("HYBRIDKV_PROPERTY_MIN", "0"))
    if floor and 0 < counter.total() < floor and session.config.getoption("--fence-policy") == "fenced":
        session.config.get_terminal_writer().line(
            f"\nhybridkv property tests: {counter.total()} generated interleavings; expected at least {floor}"
            " (HYBRIDKV_PROPERTY_MIN)", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
