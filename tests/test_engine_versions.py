"""The connectors refuse an engine of another minor release than the tested one (issue 45)."""

from __future__ import annotations

import logging

import pytest

from hybridkv.connectors.versions import TESTED, Engine, UntestedEngineVersion, check_engine_version


@pytest.mark.parametrize("engine", list(Engine))
def test_the_tested_release_passes_silently(engine, caplog):
    with caplog.at_level(logging.WARNING):
        check_engine_version(engine, TESTED[engine])
    assert caplog.records == []


def test_another_patch_release_warns_naming_both(caplog):
    with caplog.at_level(logging.WARNING):
        check_engine_version(Engine.VLLM, "0.33.1")
    assert "0.33.0" in caplog.text and "0.33.1" in caplog.text


@pytest.mark.parametrize("installed", ["0.34.0", "0.32.2", "1.33.0", "0.34.0rc1"])
def test_another_minor_release_is_refused_naming_both(installed):
    with pytest.raises(UntestedEngineVersion, match=rf"vllm==0\.33\.0; {installed} is installed"):
        check_engine_version(Engine.VLLM, installed)


def test_a_version_that_is_not_one_is_bad_input():
    with pytest.raises(ValueError, match="'dev'"):
        check_engine_version(Engine.SGLANG, "dev")
