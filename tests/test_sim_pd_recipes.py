"""Shipped recipes: strict loading, sources for every parameter, descriptor counts from the
analyzer, and a reduced sweep of each through the real CLI path."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from descriptors.schemes import Scheme, Workload, count_descriptors
from hybridkv.cli import main
from hybridkv.layout.presets import get_preset
from sims.pd.params import Scheduling
from sims.pd.recipe import load_recipe, parse_recipe, shipped_recipes
from sims.pd.sweep import run_sweep

RECIPES = shipped_recipes()


def test_the_seed_topologies_are_shipped():
    names = {p.stem for p in RECIPES}
    assert {f"seed-{n}xdep2-1xdep8" for n in range(4, 9)} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads_with_a_source_for_every_parameter(path: Path):
    recipe = load_recipe(path)
    assert recipe.sources, "a recipe must say where its numbers come from"
    for key, text in recipe.sources.items():
        kind, _, where = text.partition(":")
        assert kind in {"cited", "measured", "derived", "assumed"} and where.strip(), key


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_runs_a_reduced_sweep(path: Path):
    recipe = load_recipe(path).with_sweep((64, 512), warmup_requests=128, measure_requests=256)
    config = recipe.sim_config()
    points, skipped = run_sweep(config, recipe.sweep.concurrency, stop_at_capacity=True)
    assert [p.concurrency for p in points] == [64, 512] and skipped == ()
    low, high = points
    assert 0 < low.tokens_per_s_per_gpu < high.tokens_per_s_per_gpu
    assert low.tokens_per_s_per_user > high.tokens_per_s_per_user
    assert 0 < low.transfer_share < 1


def test_descriptor_counts_come_from_the_analyzer():
    recipe = load_recipe("seed-6xdep2-1xdep8")
    geometry = get_preset(recipe.preset, ssm_dtype=recipe.ssm_dtype)
    for scheme in ("vllm-0.33", "hybridkv"):
        config = recipe.sim_config(scheme=scheme)
        expected = count_descriptors(Scheme(scheme), Workload(
            geometry=geometry, tokens=recipe.isl, block_size=recipe.block_size,
            fragmentation=recipe.fragmentation))
        assert config.request.transfer_descriptors == expected.descriptors
        assert config.request.transfer_bytes == expected.bytes
    assert (recipe.sim_config(scheme="vllm-0.33").request.transfer_descriptors
            > recipe.sim_config(scheme="hybridkv").request.transfer_descriptors)


def test_decode_capacity_follows_the_hybrid_allocator():
    # Qwen3.5-397B, bf16 SSM: 1072-token blocks; 9216 tokens = 9 attention blocks + 3 GDN groups.
    config = load_recipe("seed-4xdep2-1xdep8").sim_config()
    assert config.request.decode_blocks == 12


def _seed_data() -> dict:
    return yaml.safe_load(Path(RECIPES[0]).read_text())


def test_a_parameter_without_a_source_is_rejected():
    data = _seed_data()
    del data["sources"]["decode.cost.device_base_s"]
    with pytest.raises(ValueError, match="without a source: decode.cost.device_base_s"):
        parse_recipe(data, Path("x.yaml"))


def test_a_source_must_say_what_kind_it_is():
    data = _seed_data()
    data["sources"]["workload.isl"] = "the blog"
    with pytest.raises(ValueError, match="sources\\['workload.isl'\\]"):
        parse_recipe(data, Path("x.yaml"))


def test_unknown_keys_and_bad_values_are_rejected():
    data = copy.deepcopy(_seed_data())
    data["decode"]["kv_dtype"] = "fp8"
    with pytest.raises(ValueError, match="unknown keys: kv_dtype"):
        parse_recipe(data, Path("x.yaml"))
    data = copy.deepcopy(_seed_data())
    data["sweep"]["concurrency"] = [128, 64]
    with pytest.raises(ValueError, match="strictly increasing"):
        parse_recipe(data, Path("x.yaml"))
    data = copy.deepcopy(_seed_data())
    data["transfer"]["scheme"] = "carrier-pigeon"
    with pytest.raises(ValueError, match="carrier-pigeon"):
        parse_recipe(data, Path("x.yaml")).sim_config()
    with pytest.raises(ValueError, match="not a file"):
        load_recipe("no-such-recipe")


def test_cli_json_has_points_and_compare_groups_by_variant(tmp_path, capsys):
    plot = tmp_path / "pareto.png"
    rc = main(["sim", "pd", "--recipe", "seed-8xdep2-1xdep8", "--concurrency", "64", "--json",
               "--compare-schemes", "--plot", str(plot)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["points"][0]) >= {"concurrency", "tokens_per_s_per_gpu", "tokens_per_s_per_user",
                                     "ttft_s", "itl_s"}
    variants = {v["name"]: v for v in out["variants"]}
    assert set(variants) == {"vllm-0.33 async", "vllm-0.33 sync", "hybridkv async", "hybridkv sync"}
    # `points` is the recipe's own configuration (vllm-0.33, async on).
    assert out["points"] == variants["vllm-0.33 async"]["points"]
    assert variants["hybridkv sync"]["descriptors_per_request"] < variants["vllm-0.33 sync"]["descriptors_per_request"]
    # At 64 users decode is CPU-heavy, so hiding the CPU behind the device shows.
    on = variants["vllm-0.33 async"]["points"][0]
    off = variants["vllm-0.33 sync"]["points"][0]
    assert on["itl_s"] < off["itl_s"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_table_for_one_recipe(capsys):
    rc = main(["sim", "pd", "--recipe", "seed-4xdep2-1xdep8", "--concurrency", "64"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "seed-4xdep2-1xdep8" in out and "tok/s/GPU" in out and "TTFT" in out


def test_cli_reports_bad_recipe_as_usage_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2]\n")
    assert main(["sim", "pd", "--recipe", str(bad)]) == 2
    assert "model" in capsys.readouterr().err


def test_scheduling_override_is_applied():
    recipe = load_recipe("seed-6xdep2-1xdep8")
    assert recipe.scheduling is Scheduling.ASYNC
    assert recipe.sim_config(scheduling=Scheduling.SYNC).scheduling is Scheduling.SYNC


def test_one_variant_per_recipe_and_compare_names_carry_the_recipe():
    from sims.pd.sweep import variants

    four, eight = load_recipe("seed-4xdep2-1xdep8"), load_recipe("seed-8xdep2-1xdep8")
    assert [v.name for v in variants([four, eight], compare_schemes=False)] == [four.name, eight.name]
    names = [v.name for v in variants([four, eight], compare_schemes=True)]
    assert len(names) == 8 and names[0] == f"{four.name} vllm-0.33 async"
    assert len(set(names)) == 8
