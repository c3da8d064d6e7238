"""Reports how many interleavings the property suite generated."""

from __future__ import annotations

import pytest

from tests.property import counter


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if counter.total():
        terminalreporter.write_line(
            f"hybridkv property tests: {counter.total()} generated interleavings "
            f"(fence policy: {terminalreporter.config.getoption('--fence-policy')})"
        )
