"""Shipped recipes: strict loading, sources for every parameter, descriptor counts from the
analyzer, and a reduced sweep of each through the real CLI path."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from hybridkv.descriptors.schemes import Scheme, Workload, count_descriptors
from hybridkv.cli import main
from hybridkv.layout.presets import get_preset
from hybridkv.sims.pd.params import Scheduling
from hybridkv.sims.pd.recipe import RECIPE_DIR, load_recipe, parse_recipe, shipped_recipes
from hybridkv.sims.pd.engine import simulate_point
from hybridkv.sims.pd.sweep import run_sweep

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
    recipe = load_recipe(path)
    low_load, high_load = recipe.sweep.loads[0], recipe.sweep.loads[len(recipe.sweep.loads) // 2]
    recipe = recipe.with_sweep((low_load, high_load), warmup_requests=64, measure_requests=128)
    config = recipe.sim_config()
    points, skipped = run_sweep(config, recipe.sweep.loads, arrivals=recipe.sweep.arrivals, seeds=(0,),
                                stop_at_capacity=True)
    assert [p.load for p in points] == [low_load, high_load] and skipped == ()
    low, high = (p.runs[0] for p in points)
    assert 0 < low.tokens_per_s_per_gpu < high.tokens_per_s_per_gpu
    assert low.tokens_per_s_per_user > high.tokens_per_s_per_user
    assert 0 < low.transfer_share < 1


def test_descriptor_counts_come_from_the_analyzer():
    recipe = load_recipe("seed-6xdep2-1xdep8")
    geometry = get_preset(recipe.preset, ssm_dtype=recipe.ssm_dtype)
    isl = recipe.traffic.isl.low
    for scheme in ("vllm-0.33", "hybridkv"):
        config = recipe.sim_config(scheme=scheme)
        expected = count_descriptors(Scheme(scheme), Workload(
            geometry=geometry, tokens=isl, block_size=recipe.block_size,
            fragmentation=recipe.fragmentation))
        assert config.sizing.transfer(isl) == (expected.descriptors, expected.bytes)
    assert (recipe.sim_config(scheme="vllm-0.33").sizing.transfer(isl)[0]
            > recipe.sim_config(scheme="hybridkv").sizing.transfer(isl)[0])


def test_kernel_block_size_key_reaches_the_analyzer(tmp_path):
    """vLLM 0.33 builds one id per attention kernel block: FlashInfer's 16-token blocks under the seed's
    1,072-token logical blocks give 8,220 ids for an 8,192-token request, not 300 (issue 49); hybridkv's
    own schemes do not depend on it. The key takes its count from the analyzer, like every other count."""
    seed = load_recipe("seed-4xdep2-1xdep8")
    assert seed.kernel_block_size is None
    assert seed.sim_config(scheme="vllm-0.33").sizing.transfer(8192)[0] == 300

    def k16(d):
        d["model"]["kernel_block_size"] = 16
        d["sources"]["model.kernel_block_size"] = "assumed: FlashInfer's 16-token kernel blocks (Blackwell)"

    recipe = load_recipe(_small_recipe(tmp_path, k16))
    assert recipe.kernel_block_size == 16
    geometry = get_preset(recipe.preset, ssm_dtype=recipe.ssm_dtype)
    for scheme in ("vllm-0.33", "hybridkv-vllm", "hybridkv"):
        expected = count_descriptors(Scheme(scheme), Workload(
            geometry=geometry, tokens=8192, block_size=recipe.block_size, fragmentation=recipe.fragmentation,
            kernel_block_size=16))
        assert recipe.sim_config(scheme=scheme).sizing.transfer(8192) == (expected.descriptors, expected.bytes)
    assert recipe.sim_config(scheme="vllm-0.33").sizing.transfer(8192)[0] == 8220
    assert seed.with_kernel_block_size(16).sim_config(scheme="vllm-0.33").sizing.transfer(8192)[0] == 8220
    # The key, like every other, needs its source.
    def unsourced(d):
        d["model"]["kernel_block_size"] = 16

    with pytest.raises(ValueError, match="model.kernel_block_size"):
        load_recipe(_small_recipe(tmp_path, unsourced))


def test_kernel_block_size_that_does_not_divide_the_block_is_one_line(tmp_path, capsys):
    def k32(d):
        d["model"]["kernel_block_size"] = 32
        d["sources"]["model.kernel_block_size"] = "assumed: a test"

    assert main(["sim", "pd", "--recipe", str(_small_recipe(tmp_path, k32)), "--concurrency", "64"]) == 2
    err = capsys.readouterr().err
    assert "model.kernel_block_size=32" in err and "1072" in err and "Traceback" not in err, err
    # The CLI flag overrides the recipe and is checked the same way.
    assert main(["sim", "pd", "--recipe", str(_small_recipe(tmp_path)), "--concurrency", "64",
                 "--kernel-block-size", "32"]) == 2
    assert "model.kernel_block_size=32" in capsys.readouterr().err
    assert main(["sim", "pd", "--recipe", str(_small_recipe(tmp_path)), "--concurrency", "64", "--seeds", "1",
                 "--kernel-block-size", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["variants"][0]["descriptors_per_request"] == 8220, out["variants"][0]


def test_each_scheme_posts_where_its_connector_does(tmp_path):
    """`--compare-schemes` charged every scheme to the decode step; vLLM's NixlConnector posts there
    (start_load_kv) but hybridkv's connector posts from its transport thread. `by-scheme` (the shipped
    recipes) gives each its own; true/false still force one answer for all."""
    seed = load_recipe("seed-4xdep2-1xdep8")
    assert seed.posting_on_step is None
    on = {s: seed.sim_config(scheme=s).posting.on_step for s in ("vllm-0.33", "vllm-hma", "hybridkv-vllm", "hybridkv")}
    assert on == {"vllm-0.33": True, "vllm-hma": True, "hybridkv-vllm": False, "hybridkv": False}

    def forced(d):
        d["transfer"]["posting"]["on_step"] = True

    recipe = load_recipe(_small_recipe(tmp_path, forced))
    assert recipe.sim_config(scheme="hybridkv").posting.on_step is True

    def bad(d):
        d["transfer"]["posting"]["on_step"] = "sometimes"

    with pytest.raises(ValueError, match="on_step='sometimes'.*by-scheme"):
        load_recipe(_small_recipe(tmp_path, bad))


def test_the_pr35758_recipe_moves_the_prs_descriptor_counts():
    # 63 blocks of 64 tokens on gemma-3-4b-it: 4,284 descriptors without HMA, 1,650 with (the PR's text).
    recipe = load_recipe("pr35758-1p1d-gemma3-4b")
    assert recipe.sim_config(scheme="vllm-legacy").sizing.transfer(4032)[0] == 4284
    assert recipe.sim_config().sizing.transfer(4032)[0] == 1650


def test_decode_capacity_follows_the_hybrid_allocator():
    # Qwen3.5-397B, bf16 SSM: 1072-token blocks; 9216 tokens = 9 attention blocks + 3 GDN groups,
    # grown from the prompt's 8 + 3 as decoding passes 8,576 tokens.
    config = load_recipe("seed-4xdep2-1xdep8").sim_config()
    assert config.sizing.decode_blocks(9216) == 12
    assert config.sizing.decode_blocks(8192) == 11
    assert config.sizing.block_tokens == 1072


def test_decode_capacity_depends_on_the_scheme():
    # gemma-3-4b-it: without HMA (vllm-legacy) every sliding-window layer keeps every block, so a
    # 4,032-token request takes far more cache than under HMA's clipped tails.
    recipe = load_recipe("pr35758-1p1d-gemma3-4b")
    legacy, hma = recipe.sim_config(scheme="vllm-legacy"), recipe.sim_config(scheme="vllm-hma")
    bytes_of = lambda c: c.sizing.decode_blocks(4032 + 256) * recipe.cache_bytes_per_rank / c.decode.blocks_per_rank  # noqa: E731
    assert bytes_of(legacy) > 2 * bytes_of(hma)
    # Every HMA scheme stores the request alike; only what moves differs.
    assert recipe.sim_config(scheme="hybridkv").decode.blocks_per_rank == hma.decode.blocks_per_rank


def _seed_data() -> dict:
    return yaml.safe_load((RECIPE_DIR / "seed-4xdep2-1xdep8.yaml").read_text())


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
    small = _small_recipe(tmp_path)
    rc = main(["sim", "pd", "--recipe", str(small), "--concurrency", "64", "--json", "--seeds", "2",
               "--compare-schemes", "vllm-0.33,vllm-legacy,hybridkv", "--plot", str(plot)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    point = out["points"][0]
    assert point["load"] == 64 and point["seeds"] == [0, 1]
    assert set(point["mean"]) >= {"tokens_per_s_per_gpu", "tokens_per_s_per_user", "ttft_s", "itl_s"}
    assert set(point["mean"]) == set(point["spread"])
    variants = {v["name"]: v for v in out["variants"]}
    assert list(variants) == ["vllm-0.33", "vllm-legacy", "hybridkv"]
    # `points` is the first scheme's, the baseline of every ratio.
    assert out["points"] == variants["vllm-0.33"]["points"]
    assert variants["vllm-0.33"]["ratio_to_first"]["64"] == {"mean": 1.0, "spread": 0.0}
    assert variants["hybridkv"]["descriptors_per_request"] < variants["vllm-0.33"]["descriptors_per_request"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _small_recipe(tmp_path: Path, edit=None) -> Path:
    """The seed recipe with short outputs and a short window, so a CLI run takes a second."""
    data = _seed_data()
    data["workload"]["osl"] = 64
    data["sweep"]["warmup_requests"] = 32
    data["sweep"]["measure_requests"] = 48
    data["sources"]["sweep.warmup_requests"] = "assumed: short window for a test"
    data["sources"]["sweep.measure_requests"] = "assumed: short window for a test"
    if edit is not None:
        edit(data)
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_cli_open_loop_and_sensitivity(tmp_path, capsys):
    small = _small_recipe(tmp_path)
    assert main(["sim", "pd", "--recipe", str(small), "--request-rate", "2", "--seeds", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["variants"][0]["arrivals"] == "open" and out["points"][0]["load"] == 2
    assert main(["sim", "pd", "--recipe", str(small), "--concurrency", "64", "--seeds", "1", "--json",
                 "--compare-schemes", "vllm-0.33,hybridkv", "--sensitivity"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["sensitivity"]
    # The model's sensitivity is the uncertainty to quote: the gain's range over every setting, per load.
    assert doc["gain_metric"] == "tokens_per_s_per_gpu"
    ranges = {r["knob"]: r for r in doc["gain_range"]}
    assert set(ranges) == {"posting", "wire", "bandwidth", "scheduling"}
    for knob, rng in ranges.items():
        gains = [r["gain"]["mean"] for r in rows if r["knob"] in (knob, "")]
        assert rng["load"] == 64 and (rng["min"], rng["max"]) == (min(gains), max(gains))
    knobs = {r["knob"] for r in rows}
    assert knobs == {"", "posting", "wire", "bandwidth", "scheduling"}
    # Free posting and free wire descriptors leave nothing for fewer descriptors to win, but bytes:
    # both schemes move the same bytes, so the gain is 1 up to the scheme's other differences.
    assert all(r["gain"]["mean"] > 0 for r in rows)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["decode"].update(cache_bytes_per_rank=float("inf")), "decode.cache_bytes_per_rank=inf"),
    (lambda d: d["transfer"]["link"].update(bytes_per_s=float("nan")), "transfer.link.bytes_per_s=nan"),
    (lambda d: d["transfer"]["link"].update(bytes_per_s=0), "transfer.link.bytes_per_s=0"),
    (lambda d: d["decode"].update(cost={k: 0.0 for k in d["decode"]["cost"]}), "decode.cost: every term is zero"),
    (lambda d: d["prefill"].update(cost={k: 0.0 for k in d["prefill"]["cost"]}), "prefill.cost: every term is zero"),
    (lambda d: d["transfer"]["link"].pop("latency_s"), "missing 'transfer.link.latency_s'"),
    (lambda d: d["decode"]["cost"].pop("device_per_token_s"), "missing 'decode.cost.device_per_token_s'"),
    (lambda d: d["transfer"]["posting"].update(per_descriptor_s=-1e-6), "per_descriptor_s=-1e-06"),
    (lambda d: d["decode"].update(cache_bytes_per_rank=1.0), "holds no block"),
    (lambda d: d["workload"].update(isl={"distribution": "uniform", "low": 9000, "high": 8000}), "high=8000"),
    (lambda d: d["sweep"].update(request_rate=[1.0]), "exactly one of 'concurrency'"),
    (lambda d: d["transfer"].update(scheme="carrier-pigeon"), "carrier-pigeon"),
], ids=["inf-cache", "nan-bandwidth", "zero-bandwidth", "zero-decode", "zero-prefill", "no-latency",
        "no-cost-key", "negative-posting", "tiny-cache", "bad-lengths", "two-sweeps", "bad-scheme"])
def test_degenerate_recipes_are_one_line_errors(tmp_path, capsys, edit, message):
    # The sources stay as they are: the values themselves are refused, before any simulation.
    path = _small_recipe(tmp_path, edit)
    assert main(["sim", "pd", "--recipe", str(path), "--concurrency", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridkv: error: ") and message in err, err
    assert "Traceback" not in err


def test_cli_table_for_one_recipe(tmp_path, capsys):
    rc = main(["sim", "pd", "--recipe", str(_small_recipe(tmp_path)), "--concurrency", "64", "--seeds", "2"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "seed-4xdep2-1xdep8" in out and "tok/s/GPU" in out and "TTFT" in out and " ± " in out


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
    from hybridkv.sims.pd.sweep import parse_schemes, variants

    four, eight = load_recipe("seed-4xdep2-1xdep8"), load_recipe("seed-8xdep2-1xdep8")
    assert [v.name for v in variants([four, eight])] == [four.name, eight.name]
    names = [v.name for v in variants([four, eight], schemes=("vllm-0.33", "hybridkv"))]
    assert names == [f"{four.name} vllm-0.33", f"{four.name} hybridkv", f"{eight.name} vllm-0.33",
                     f"{eight.name} hybridkv"]
    for bad in ("hybridkv", "hybridkv,hybridkv", "vllm-0.33,nope", "vllm-0.33,"):
        with pytest.raises(ValueError):
            parse_schemes(bad)


def test_attention_tp_keys_take_their_counts_from_the_analyzer(tmp_path):
    """prefill.attention_tp / decode.attention_tp: a rank is that many GPUs. The link carries every read of the
    decode rank (the analyzer's total), each GPU's posting thread posts its own share (per_posting_rank), its
    GPUs hold a head slice of each block, and every GPU counts. Issue 49's case: TP 8 -> 2 at 16-token kernel
    blocks, 32,880 vLLM 0.33 ids per decode rank."""
    def tp(d):
        d["prefill"]["attention_tp"] = 8
        d["decode"]["attention_tp"] = 2
        d["model"]["kernel_block_size"] = 16
        for key in ("prefill.attention_tp", "decode.attention_tp", "model.kernel_block_size"):
            d["sources"][key] = "assumed: a test"

    recipe = load_recipe(_small_recipe(tmp_path, tp))
    assert (recipe.tp_prefill, recipe.tp_decode) == (8, 2)
    geometry = get_preset(recipe.preset, ssm_dtype=recipe.ssm_dtype)
    flat = load_recipe("seed-4xdep2-1xdep8").sim_config()
    for scheme in ("vllm-0.33", "hybridkv-vllm", "hybridkv", "sglang-nixl"):
        config = recipe.sim_config(scheme=scheme)
        count = count_descriptors(Scheme(scheme), Workload(
            geometry=geometry, tokens=8192, block_size=recipe.block_size, fragmentation=recipe.fragmentation,
            kernel_block_size=16, tp_prefill=8, tp_decode=2))
        assert config.sizing.transfer(8192) == (count.descriptors, count.bytes)
        assert config.sizing.posted_descriptors(8192) == count.per_posting_rank
    config = recipe.sim_config(scheme="vllm-0.33")
    assert config.sizing.posted_descriptors(8192) == 32_880 and config.typical_posted() == 32_880
    assert config.typical_transfer_s() > config.posting.seconds(32_880) > 0.05
    assert config.total_gpus == 4 * 2 * 8 + 8 * 2
    assert (config.prefill.gpus_per_rank, config.decode.gpus_per_rank) == (8, 2)
    assert config.decode.ranks_per_node == 2  # 4 GPUs per tray, 2 per rank
    # A TP 2 rank's GPUs each hold half of each block's heads: twice the blocks of a TP 1 rank.
    assert config.decode.blocks_per_rank == pytest.approx(2 * flat.decode.blocks_per_rank, rel=0.01)
    # The CLI flags override the recipe, checked alike; TP 1 (the shipped recipes) is unchanged.
    assert load_recipe("seed-4xdep2-1xdep8").with_tp(8, 2).with_kernel_block_size(16).sim_config(
        scheme="vllm-0.33").sizing.posted_descriptors(8192) == 32_880

    def unsourced(d):
        d["decode"]["attention_tp"] = 2

    with pytest.raises(ValueError, match="decode.attention_tp"):
        load_recipe(_small_recipe(tmp_path, unsourced))


@pytest.mark.parametrize(("argv", "message"), [
    (["--tp-decode", "8"], "decode.attention_tp=8: a decode rank's GPUs must fit whole in a node of "
                           "decode.ranks_per_node=4"),
    (["--tp-decode", "3"], "decode.attention_tp=3"),
    (["--tp-prefill", "0"], "--tp-prefill 0: expected an integer >= 1"),
])
def test_attention_tp_bad_values_are_one_line(tmp_path, capsys, argv, message):
    assert main(["sim", "pd", "--recipe", str(_small_recipe(tmp_path)), "--concurrency", "64", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridkv: error: ") and message in err and err.count("\n") == 1, err


def test_cli_tp_pair_reports_what_a_posting_thread_posts(tmp_path, capsys):
    assert main(["sim", "pd", "--recipe", str(_small_recipe(tmp_path)), "--concurrency", "64", "--seeds", "1",
                 "--tp-prefill", "8", "--tp-decode", "2", "--kernel-block-size", "16", "--json",
                 "--compare-schemes", "vllm-0.33,hybridkv"]) == 0
    variants = {v["name"]: v for v in json.loads(capsys.readouterr().out)["variants"]}
    vllm, ours = variants["vllm-0.33"], variants["hybridkv"]
    assert (vllm["tp_prefill"], vllm["tp_decode"], vllm["total_gpus"]) == (8, 2, 80)
    assert (vllm["descriptors_per_request"], vllm["descriptors_posted_per_thread"]) == (65_760, 32_880)
    assert (ours["descriptors_per_request"], ours["descriptors_posted_per_thread"]) == (24, 12)
    assert vllm["posting_on_step"] is True and ours["posting_on_step"] is False
    assert vllm["ratio_metric"] == "tokens_per_s_per_gpu"


def test_open_loop_compares_ttft_at_equal_rate_and_capacity_not_throughput(tmp_path, capsys):
    """In open loop tok/s/GPU is the offered load: the report compares TTFT where neither side is overloaded
    and the capacity (highest rate without backlog growth), never the throughput ratio."""
    small = _small_recipe(tmp_path)
    assert main(["sim", "pd", "--recipe", str(small), "--request-rate", "5", "400", "--seeds", "1", "--json",
                 "--compare-schemes", "vllm-0.33,hybridkv-vllm", "--kernel-block-size", "16", "--capacity"]) == 0
    variants = {v["name"]: v for v in json.loads(capsys.readouterr().out)["variants"]}
    base, other = variants["vllm-0.33"], variants["hybridkv-vllm"]
    assert base["ratio_metric"] == other["ratio_metric"] == "ttft_s"
    assert other["ratio_to_first"]["5.0"]["mean"] < 1  # fewer ids: a shorter wait for the first token
    assert other["ratio_to_first"]["400.0"] is None and other["points"][1]["overloaded"]  # no TTFT past capacity
    for v in (base, other):
        cap = v["capacity"]
        assert cap["searched"] and 5 <= cap["rate"] < cap["above"] <= cap["rate"] * 1.02 + 1e-9
    assert other["capacity_ratio_to_first"] == pytest.approx(other["capacity"]["rate"] / base["capacity"]["rate"])
    assert main(["sim", "pd", "--recipe", str(small), "--request-rate", "5", "400", "--seeds", "1",
                 "--compare-schemes", "vllm-0.33,hybridkv-vllm"]) == 0
    text = capsys.readouterr().out
    assert "offered load" in text and "capacity" in text and "overloaded" in text
    assert main(["sim", "pd", "--recipe", str(small), "--concurrency", "64", "--capacity"]) == 2
    assert "--capacity searches an open loop" in capsys.readouterr().err


def test_open_loop_window_waits_for_the_system_to_fill():
    """At TP 8 -> 2 with 16-token kernel blocks vLLM 0.33's decode steps carry ~163 ms of posting each (32,880 ids
    at the H100's 4.95 us), so a request lives long and many are in the system at 15 requests/s. A fixed window
    (512 completions, then 2,048) measures that fill, and its growth reads as overload; the default window waits
    for twice the requests in the system and measures four times them, and sees a steady state below capacity."""
    from hybridkv.sims.pd.params import Arrivals

    recipe = load_recipe("seed-4xdep2-1xdep8").with_tp(8, 2).with_kernel_block_size(16)
    fixed = recipe.with_sweep(warmup_requests=512, measure_requests=2048).sim_config(scheme="vllm-0.33")
    filling = simulate_point(fixed, 15.0, arrivals=Arrivals.OPEN)
    assert filling.backlog_growth > 0.05 * filling.completed
    steady = simulate_point(recipe.sim_config(scheme="vllm-0.33"), 15.0, arrivals=Arrivals.OPEN)
    assert steady.completed > 4000 and abs(steady.backlog_growth) < 0.02 * steady.completed
