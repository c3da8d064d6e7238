"""`hybridkv bench vllm-steps` runs at a tiny size against the real vLLM 0.33.0 Scheduler."""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

import pytest

from tests.vllm import harness as h  # noqa: F401  (sets vLLM's CPU platform before vLLM is imported)

ROOT = Path(__file__).resolve().parents[2]


def test_the_command_is_registered():
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["hybridkv.commands"]
    assert eps["bench.vllm-steps"] == "hybridkv.benchmarks.vllm_steps:register"


def test_it_runs_at_a_tiny_size(capsys):
    from hybridkv.benchmarks import vllm_steps

    parser = argparse.ArgumentParser()
    vllm_steps.register(parser)
    args = parser.parse_args(["--requests", "6", "--block-tokens", "16", "1056", "--prompt", "40", "--steps", "2",
                              "--json"])
    assert args.handler(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["block_tokens"] for c in doc["cases"]] == [16, 1056]
    for case in doc["cases"]:
        assert case["requests"] == 6 and case["steps"] == 2
        assert case["schedule_us"] > 0 and case["build_connector_meta_us"] > 0
        assert case["connector_vs_schedule"] == pytest.approx(
            (case["build_connector_meta_us"] + case["update_connector_output_us"]) / case["schedule_us"], rel=0.01)


def test_without_vllm_it_names_the_extra(monkeypatch):
    from hybridkv.benchmarks import vllm_steps
    from hybridkv.errors import MissingExtra

    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM imports
    with pytest.raises(MissingExtra, match=r'"vllm" extra'):
        vllm_steps.measure(block_tokens=16, requests=1, prompt=8, steps=1)
