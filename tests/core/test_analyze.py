import json
import subprocess
import sys

import pytest

from hybridkv.descriptors.schemes import Scheme, Workload, count_all, count_descriptors, runs
from hybridkv.cli import main
from hybridkv.layout.geometry import AttentionSpec, GDNSpec, ModelGeometry
from hybridkv.layout.presets import get_preset


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
