"""Shared pytest configuration.

`--fence-policy` selects the policy the race tests run under: the suite must
pass with `fenced` and fail with `none` (that is how we know it can fail).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# CI runs a bounded but large number of interleavings; local runs stay quick. Neither profile is
# derandomized: hypothesis's own "ci" profile (loaded when CI is set, and the parent of ours then)
# replays the same examples every run. Fresh examples each run, from a seed tests/property/conftest.py
# picks and prints; the fixed corpus is the tests' explicit @example cases.
settings.register_profile("ci", deadline=None, print_blob=True, derandomize=False, database=None)
settings.register_profile("dev", deadline=None, derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fence-policy",
        choices=("fenced", "none"),
        default="fenced",
        help="fence policy for the race tests (default: fenced)",
    )


@pytest.fixture(scope="session")
def fence_policy_name(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--fence-policy")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the H200 via the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
