import dataclasses
import json
import subprocess
import sys

import pytest

from hybridkv.descriptors.schemes import Scheme, Workload, count_all, count_descriptors, runs
from hybridkv.cli import main
from hybridkv.layout.geometry import AttentionSpec, GDNSpec, ModelGeometry
from hybridkv.layout.presets import get_preset
from hybridkv.transport.staging import StagingConfig, StagingMode


def counts(w):
    return {c.scheme.value: c.descriptors for c in count_all(w)}


def test_gemma_published_counts():
    c = counts(Workload(geometry=get_preset("gemma-3-4b-it"), tokens=4000, block_size=64))
    assert c["vllm-legacy"] == 4284  # vLLM PR #35758, non-HMA
    assert c["vllm-hma"] == 1650     # PR #35758, HMA
    assert c["vllm-0.33"] == 825     # packed K/V
    assert c["hybridkv"] == 80 and c["hybridkv"] <= 80
    assert c["hybridkv-vllm"] == 165


def test_qwen397b_ten_times_fewer_than_vllm_033():
    c = counts(Workload(geometry=get_preset("qwen3.5-397b-a17b"), tokens=8192))
    assert c["vllm-0.33"] == 15 * 4 + 3 * 15 * 4  # R * FA blocks + R * 4 sub-reads per GDN group
    assert c["vllm-0.33"] >= 10 * c["hybridkv"]


def test_tiny_geometry_exact_counts():
    attn = AttentionSpec(num_kv_heads=2, head_dim=16)
    gdn = GDNSpec(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)
    g = ModelGeometry(name="tiny", layers=(gdn, gdn, gdn, attn) * 2)
    w = Workload(geometry=g, tokens=100, block_size=16, fragmentation=1.0)
    bs = w.effective_block_size
    n = -(-100 // bs)
    c = counts(w)
    assert c["vllm-legacy"] == 2 * 2 * n + 2 * 6
    # groups: group_size = 2 (attention count); GDN 6 layers -> 3 groups; R = 2
    assert c["vllm-0.33"] == 2 * n + 3 * 2 * 4
    assert c["vllm-hma"] == 2 * 2 * n + 3 * 2 * 4
    assert c["sglang-nixl"] == 2 * 2 * n + 2 * 6
    assert c["mooncake"] == 2 * 2 * runs(n, 1.0) + 2 * 6
    assert c["hybridkv"] == n + 1
    assert c["hybridkv-vllm"] == n + 3
    # Fully contiguous blocks: hybridkv moves each kind in one descriptor.
    assert counts(Workload(geometry=g, tokens=100, block_size=16, fragmentation=0.0))["hybridkv"] == 2


def test_all_schemes_move_the_same_useful_bytes_for_hybridkv():
    w = Workload(geometry=get_preset("qwen3.5-35b-a3b"), tokens=8192, tp_prefill=2, tp_decode=4)
    by = {c.scheme: c for c in count_all(w)}
    assert by[Scheme.HYBRIDKV].bytes == by[Scheme.VLLM_033].bytes


def test_heterogeneous_tp_counts():
    g = get_preset("qwen3.5-397b-a17b")
    assert count_descriptors(Scheme.HYBRIDKV, Workload(geometry=g, tokens=8192, tp_prefill=2, tp_decode=4)).descriptors == 4 * 5
    # P TP 4 > D TP 2: replicated KV heads read once; GDN from two prefill ranks.
    assert count_descriptors(Scheme.HYBRIDKV, Workload(geometry=g, tokens=8192, tp_prefill=4, tp_decode=2)).descriptors == 2 * 6


def test_cli_json_shape(capsys):
    assert main(["analyze", "--model", "gemma-3-4b-it", "--tokens", "4000", "--block-size", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["workload"]["block_size"] == 64
    names = [s["name"] for s in out["schemes"]]
    assert names == [s.value for s in Scheme]
    assert all(set(s) >= {"name", "descriptors", "bytes", "regions"} for s in out["schemes"])


@pytest.mark.parametrize("argv,needle", [
    (["--model", "nope"], "unknown model 'nope'"),
    (["--tokens", "0"], "tokens must be a positive int, got 0"),
    (["--tokens", "-5"], "got -5"),
    (["--block-size", "24"], "multiple of 16, got 24"),
    (["--tp-decode", "3"], "tp 3"),
    (["--config", "/nonexistent/config.json"], "does not exist"),
    (["--fragmentation", "1.5"], "fragmentation must be in [0, 1], got 1.5"),
])
def test_cli_bad_input_exits_2_naming_the_value(argv, needle):
    proc = subprocess.run([sys.executable, "-m", "hybridkv.cli", "analyze", *argv], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr


def test_cli_human_table():
    proc = subprocess.run([sys.executable, "-m", "hybridkv.cli", "analyze", "--model", "qwen3.5-0.8b"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "hybridkv" in proc.stdout and "vllm-0.33" in proc.stdout


def test_kernel_block_split_multiplies_vllm_033_attention_reads():
    g = get_preset("qwen3.5-397b-a17b")
    w = Workload(geometry=g, tokens=8192, kernel_block_size=16)
    assert w.kernel_blocks_per_block == 2096 // 16 == 131
    assert count_descriptors(Scheme.VLLM_033, w).descriptors == 15 * 4 * 131 + 3 * 15 * 4
    assert count_descriptors(Scheme.HYBRIDKV_VLLM, w).descriptors == 7  # block-outermost: still one span
    with pytest.raises(ValueError, match="must divide the block size 2096"):
        Workload(geometry=g, tokens=8192, kernel_block_size=64)


def _qwen_bf16(**kw):
    return Workload(geometry=get_preset("qwen3.5-397b-a17b", ssm_dtype="bfloat16"), tokens=8192, **kw)


def test_per_rank_counts_are_what_one_posting_thread_sees():
    """Counts are totals over every (prefill rank, decode rank) read; a posting thread sees its rank's share:
    per decode rank where the decode pulls (vLLM, hybridkv), per prefill rank where the prefill pushes (SGLang,
    Mooncake). Issue 49's TP 8 -> 2 with 16-token kernel blocks: 65,760 vLLM 0.33 ids, 32,880 per decode rank."""
    w = _qwen_bf16(tp_prefill=8, tp_decode=2, kernel_block_size=16)
    by = {c.scheme: c for c in count_all(w)}
    vllm = by[Scheme.VLLM_033]
    assert (vllm.descriptors, vllm.per_decode_rank, vllm.per_prefill_rank) == (65_760, 32_880, 8_220)
    assert vllm.per_posting_rank == 32_880 and vllm.poster.on_step
    # Head slices of consecutive kernel blocks do not touch: nothing for NIXL to merge at different TP.
    assert vllm.nixl_posted_per_posting_rank == 32_880
    assert vllm.bytes_per_decode_rank * 2 == vllm.bytes
    sglang = by[Scheme.SGLANG_NIXL]
    assert sglang.poster.side.value == "prefill" and sglang.per_posting_rank == sglang.descriptors // 8
    ours = by[Scheme.HYBRIDKV]
    assert ours.per_decode_rank * 2 == ours.descriptors == 24 and not ours.poster.on_step
    # Staging (transport/staging.py) weighs copies against descriptors: hybridkv's own layout posts 3 per read
    # and stays sliced. Inside vLLM's layer-outermost pages (the layout 16-token kernel blocks need) a decode
    # rank's one KV head (2 at TP 2; TP 8 replicates them) is a whole attention page of one prefill rank, read
    # once: 15 slots x 8 blocks, its kernel blocks merged, + 180 GDN head slices (300, 144 MB: AUTO keeps it
    # sliced, a pack and unpack of that cost more than posting them, at the measured H100 costs of 4.95 us per
    # descriptor and a 30 GB/s gather). The other three prefill ranks give their 180 GDN slices only, and the
    # Want's field mask has them pack only those (12 MB, not the replicated KV head too): AUTO stages each into
    # one slot (179 x 4.95 us > 2 x 12 MB at 30 GB/s), 300 + 3 per decode rank. Staging ON packs every prefill
    # rank's part into one slot.
    ours_vllm = by[Scheme.HYBRIDKV_VLLM]
    assert (ours_vllm.descriptors, ours_vllm.per_decode_rank) == (606, 303)
    on = count_descriptors(Scheme.HYBRIDKV_VLLM, dataclasses.replace(w, staging=StagingConfig(mode=StagingMode.ON)))
    assert (on.descriptors, on.per_decode_rank) == (8, 4)
    fast = count_descriptors(Scheme.HYBRIDKV_VLLM, dataclasses.replace(w, staging=StagingConfig(copy_gbps=1000.0)))
    assert fast.descriptors == 8  # a gather near copy speed would be worth it
    sliced = count_descriptors(Scheme.HYBRIDKV_VLLM, dataclasses.replace(w, staging=None))
    assert (sliced.descriptors, sliced.per_decode_rank) == (1_680, 840)
    # One decode rank reading from a TP 1 prefill: half the prefill rank's readers each.
    up = {c.scheme: c for c in count_all(_qwen_bf16(tp_prefill=1, tp_decode=2))}
    assert up[Scheme.VLLM_033].per_decode_rank == 300 and up[Scheme.VLLM_033].per_prefill_rank == 600
    for c in count_all(_qwen_bf16(tp_prefill=2, tp_decode=2)):
        assert c.per_decode_rank * 2 == c.descriptors


def test_kernel_blocks_of_one_block_merge_in_nixl_at_equal_tp():
    """vLLM 0.33 builds 8,220 ids at 16-token kernel blocks; the kernel blocks of one logical block touch on
    both sides at equal TP, and NIXL posts touching pieces as one (docs/benchmarks/transfer.md), so 300 post."""
    vllm = count_descriptors(Scheme.VLLM_033, _qwen_bf16(kernel_block_size=16))
    assert (vllm.per_posting_rank, vllm.nixl_posted_per_posting_rank) == (8_220, 300)


def test_tp_pair_that_neither_divides_is_refused():
    attn = AttentionSpec(num_kv_heads=6, head_dim=16)
    gdn = GDNSpec(num_k_heads=6, num_v_heads=6, head_k_dim=16, head_v_dim=16)
    g = ModelGeometry(name="six-heads", layers=(gdn, gdn, gdn, attn))
    with pytest.raises(ValueError, match="tp_prefill 2 and tp_decode 3: one must be a multiple"):
        Workload(geometry=g, tokens=100, tp_prefill=2, tp_decode=3)


def test_cli_answers_does_this_matter(capsys):
    """`analyze` prints per scheme the ids a posting thread builds, what NIXL posts, the posting cost on that
    thread from the measured figures (source named, GPU hosts flagged), and its share of the decode step."""
    argv = ["analyze", "--model", "qwen3.5-397b-a17b", "--ssm-dtype", "bfloat16", "--tp-prefill", "8",
            "--tp-decode", "2", "--kernel-block-size", "16", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"workload", "posting_cost", "budget", "schemes"}
    cost = out["posting_cost"]
    assert (cost["per_descriptor_us"], cost["per_transfer_us"]) == (4.95, 60.0)
    assert "docs/benchmarks/transfer.md" in cost["source"] and "H100" in cost["source"]
    assert "CPU" in cost["gpu_host_note"]
    budget = out["budget"]
    assert budget["decode_step_ms"] == 10.0 and budget["transfers_per_step"] == 256 / 1024
    assert set(budget["sources"]) == {"decode_step_ms", "decode_batch", "osl"}
    rows = {r["name"]: r for r in out["schemes"]}
    keys = {"per_decode_rank", "per_prefill_rank", "bytes_per_decode_rank", "posted_by", "per_posting_rank",
            "nixl_posted_per_posting_rank", "posting_ms", "step_share"}
    assert all(keys <= set(r) for r in rows.values())
    vllm = rows["vllm-0.33"]
    assert vllm["per_posting_rank"] == 32_880 and vllm["posted_by"] == {
        "side": "decode", "on_step": True, "where": vllm["posted_by"]["where"]}
    assert vllm["posting_ms"]["ids"] == pytest.approx((60 + 32_880 * 4.95) / 1e3)
    assert vllm["step_share"]["ids"] == pytest.approx(vllm["posting_ms"]["ids"] * 0.25 / 10)
    assert rows["hybridkv"]["per_posting_rank"] == 12 and rows["hybridkv"]["posted_by"]["on_step"] is False
    assert rows["sglang-nixl"]["step_share"] is None  # posted on the prefill's threads
    # The step budget and the measured cost are inputs: another host's figures move the answer.
    assert main([*argv[:-1], "--per-desc-us", "2", "--per-transfer-us", "85", "--step-ms", "30", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    vllm = next(r for r in out["schemes"] if r["name"] == "vllm-0.33")
    assert vllm["posting_ms"]["ids"] == pytest.approx((85 + 32_880 * 2) / 1e3)
    assert out["posting_cost"]["source"] == "given on the command line" and out["budget"]["sources"]["decode_step_ms"] == "given"
    assert main(argv[:-1]) == 0
    text = capsys.readouterr().out
    assert "share of decode" in text and "decode step" in text and "32,880" in text


@pytest.mark.parametrize("argv,needle", [
    (["--step-ms", "0"], "--step-ms 0.0: expected a decode step time > 0 ms"),
    (["--decode-batch", "0"], "--decode-batch 0: expected an integer >= 1"),
    (["--osl", "0"], "--osl 0: expected an integer >= 1"),
    (["--per-transfer-us", "-1"], "--per-transfer-us must be >= 0"),
    (["--step-ms", "nan"], "outside the bound"),
])
def test_cli_budget_bad_input_is_one_error_line(capsys, argv, needle):
    try:
        rc = main(["analyze", "--model", "qwen3.5-0.8b", *argv])
    except SystemExit as exc:  # argparse's own refusals exit from inside main
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridkv: error: ") and needle in err and err.count("\n") == 1, err
