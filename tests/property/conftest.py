"""Reports how many interleavings the property suite generated, and holds the CI budget to its floor.

scripts/test.sh (the README's test command, which .ci/run runs) sets HYBRIDKV_PROPERTY_MIN=10000:
a run of the property suite that generated fewer interleavings then fails instead of passing quietly.
"""

from __future__ import annotations

import os

import pytest

from tests.property import counter


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if counter.total():
        terminalreporter.write_line(
            f"hybridkv property tests: {counter.total()} generated interleavings "
            f"(fence policy: {terminalreporter.config.getoption('--fence-policy')})"
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    floor = int(os.environ.get("HYBRIDKV_PROPERTY_MIN", "0"))
    if floor and 0 < counter.total() < floor and session.config.getoption("--fence-policy") == "fenced":
        session.config.get_terminal_writer().line(
            f"\nhybridkv property tests: {counter.total()} generated interleavings; expected at least {floor}"
            " (HYBRIDKV_PROPERTY_MIN)", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
