"""CPU: `hybridkv bench gdn` refuses what it cannot measure, and the breakdown's arithmetic and table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridkv.benchmarks.gdn.breakdown import Breakdown, render


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridkv.cli", "bench", "gdn", *args], capture_output=True,
                          text=True, timeout=120)


def test_breakdown_idle_is_call_time_minus_kernel_time():
    b = Breakdown(name="hybridkv", call_us=100.0, kernels=(("_chunk_state_kernel", 60.0), ("_inv", 25.5)))
    assert b.kernel_us == pytest.approx(85.5)
    assert b.idle_us == pytest.approx(14.5)
    # Profiler and event clocks differ slightly: a call never shows negative idle time.
    assert Breakdown(name="x", call_us=10.0, kernels=(("k", 10.4),)).idle_us == 0.0
    text = render("35B 1x8192", [b])
    assert text.splitlines()[0] == "35B 1x8192"
    assert "call    100.0 us = kernels     85.5 + idle    14.5" in text
    # A pipelined call's kernels overlap on two streams: said so, not shown as zero idle.
    piped = Breakdown(name="hybridkv", call_us=480.0, kernels=(("_chunk_state_kernel", 450.0), ("_inv", 145.0)))
    assert piped.overlap_us == pytest.approx(115.0) and piped.idle_us == 0.0
    assert "call    480.0 us < kernels    595.0: 115.0 us ran side by side" in render("35B 1x8192", [piped])
    assert "60.0 us  _chunk_state_kernel" in text


@pytest.mark.parametrize(("args", "message"), [
    (("--iters", "0"), "--iters must be >= 1, got 0"),
    (("--breakdown",), "bench gdn: torch sees no CUDA device"),
    (("--warm-jobs", "-1"), "--warm-jobs must be >= 0, got -1"),
    (("--shape", "1x9"), "--shape ['1x9'] matches no prefill shape; the shapes are: 397B H=16 HV=64 1x8192;"),
    (("--breakdown", "--host-profile"), "--breakdown and --host-profile are two separate runs"),
])
def test_bench_gdn_refuses_with_a_clear_error(args, message):
    torch = pytest.importorskip("torch")
    if "--breakdown" in args and torch.cuda.is_available():
        pytest.skip("with a GPU this would run the benchmark")
    done = _cli(*args)
    assert done.returncode != 0
    assert message in done.stderr


def test_tuned_choices_name_each_self_tuning_kernel():
    pytest.importorskip("triton")
    from hybridkv.benchmarks.gdn import command as bench  # noqa: F401
    from hybridkv.kernels.gdn import chunk as triton_chunk  # noqa: F401
    from hybridkv.kernels.gdn import decode  # noqa: F401  (the decode tuner's choices live here)

    tuned = bench._tuned_choices()
    assert set(tuned) == {"chunk state (H, HV, log2 work, K, V; BV, warps, stages)", "decode (kernel, config)"}
    assert all(picks == {} for picks in tuned.values())  # nothing ran here


# --- FlashQLA beside FLA (issue 23): which function each column calls, and what the run reports ---------------------

@pytest.fixture
def faked_fla(monkeypatch):
    """fla-core 0.6.0's dispatch as far as the bench relies on it: a backend registry that picks FlashQLA while
    `flash_qla` is installed unless FLA_FLASH_QLA=0, read at every call (fla/backends.py)."""
    import os
    import types

    calls: list[str] = []
    state = {"honours_switch": True}

    class Registry:
        def get_active(self):
            if state["honours_switch"] and os.environ.get("FLA_FLASH_QLA", "1") == "0":
                return None
            return types.SimpleNamespace(backend_type="flash_qla")

    registry = Registry()

    def load(operation):
        assert operation == "gated_delta_rule"
        return registry

    def chunk(*args, **kwargs):
        calls.append("triton" if registry.get_active() is None else "flash_qla")
        return calls[-1]

    fla = types.ModuleType("fla")
    fla.__version__ = "0.6.0"
    fla.backends = types.ModuleType("fla.backends")
    fla.backends._load_operation_registry = load
    fla.ops = types.ModuleType("fla.ops")
    fla.ops.gated_delta_rule = types.ModuleType("fla.ops.gated_delta_rule")
    fla.ops.gated_delta_rule.chunk_gated_delta_rule = chunk
    fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule = lambda *a, **k: "recurrent"
    for name, module in (("fla", fla), ("fla.backends", fla.backends), ("fla.ops", fla.ops),
                         ("fla.ops.gated_delta_rule", fla.ops.gated_delta_rule)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
    return types.SimpleNamespace(calls=calls, state=state)


def test_fla_column_bypasses_the_flash_qla_dispatch_faked_fla_modules(faked_fla):
    import os

    from hybridkv.benchmarks.gdn import baselines

    assert baselines.fla_default_backend() == "flash_qla"  # what a plain FLA call would time
    loaded = baselines.load_fla_chunk()
    assert loaded.fn is not None
    assert loaded.note == "fla-core 0.6.0, Triton path (FLA_FLASH_QLA=0; default would be flash_qla)"
    assert loaded.fn("q", "k", "v", "g", "beta", cu_seqlens=None) == "triton"
    assert faked_fla.calls == ["triton"]
    assert "FLA_FLASH_QLA" not in os.environ  # the switch is set only for the call
    # ... and put back as it was when the caller had set it.
    os.environ["FLA_FLASH_QLA"] = "1"
    try:
        assert loaded.fn() == "triton" and os.environ["FLA_FLASH_QLA"] == "1"
    finally:
        del os.environ["FLA_FLASH_QLA"]
    # The probes' loader hands out the same function.
    from hybridkv.benchmarks.gdn import rows as bench_rows

    chunk, recurrent = bench_rows._load_fla(False)
    assert chunk() == "triton" and recurrent() == "recurrent"


def test_fla_column_left_empty_when_the_switch_does_not_bypass_the_dispatch_faked_fla_modules(faked_fla):
    from hybridkv.benchmarks.gdn import baselines
    from hybridkv.benchmarks.gdn import rows as bench_rows

    faked_fla.state["honours_switch"] = False  # a later FLA that renamed its switch
    loaded = baselines.load_fla_chunk()
    assert loaded.fn is None
    assert loaded.note == "FLA_FLASH_QLA=0 leaves FLA's dispatch on backend 'flash_qla', not its Triton path"
    assert bench_rows._load_fla(False) is None


def test_flash_qla_is_called_through_its_own_api_with_auto_cp_faked_flash_qla_module(monkeypatch):
    import types

    from hybridkv.benchmarks.gdn import baselines

    seen = {}
    qla = types.ModuleType("flash_qla")
    qla.__version__ = "0.1.3"
    qla.chunk_gated_delta_rule = lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs) or "qla"
    monkeypatch.setitem(sys.modules, "flash_qla", qla)
    loaded = baselines.load_flash_qla()
    assert loaded.note == "flash-qla 0.1.3, auto_cp=True"
    assert loaded.fn("q", "k", output_final_state=True, cu_seqlens=None) == "qla"
    assert seen == {"args": ("q", "k"), "kwargs": {"auto_cp": True, "output_final_state": True, "cu_seqlens": None}}


def test_flash_qla_absent_or_broken_leaves_its_column_empty(monkeypatch, tmp_path):
    from hybridkv.benchmarks.gdn import baselines

    monkeypatch.setitem(sys.modules, "flash_qla", None)  # not installed
    loaded = baselines.load_flash_qla()
    assert loaded.fn is None and loaded.note.startswith("not installed (ModuleNotFoundError")
    # Installed, but TileLang cannot start (no GPU, no nvcc): the bench goes on without it.
    monkeypatch.delitem(sys.modules, "flash_qla")
    (tmp_path / "flash_qla").mkdir()
    (tmp_path / "flash_qla" / "__init__.py").write_text("raise ValueError('No CUDA architecture was specified')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = baselines.load_flash_qla()
    assert loaded.fn is None
    assert loaded.note == "failed to import (ValueError: No CUDA architecture was specified)"


def test_prefill_shapes_are_issue_23s_table_and_shape_selection():
    from hybridkv.benchmarks.gdn import cases as bench_cases

    assert [s.label for s in bench_cases.PREFILL_SHAPES] == [
        "397B H=16 HV=64 1x8192", "397B H=16 HV=64 4x8192", "397B H=16 HV=64 1x32768", "397B TP8 H=2 HV=8 1x8192",
        "397B H=16 HV=64 16x2048 varlen", "35B H=16 HV=32 1x8192", "35B H=16 HV=32 4x8192",
        "35B H=16 HV=32 16x2048 varlen", "35B H=16 HV=32 varlen 5000,1237,1955,3"]
    assert [i for i, _ in bench_cases._select(["TP8", "varlen 5000"])] == [3, 8]
    with pytest.raises(ValueError, match=r"--shape \['1x9'\] matches no prefill shape; the shapes are: 397B H=16"):
        bench_cases._select(["1x9"])


def test_rotations_give_every_implementation_each_place_in_turn():
    from hybridkv.benchmarks.gdn import timing as bench_timing

    assert list(bench_timing._rotations(["a", "b", "c"], 4)) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                          ["a", "b", "c"]]


@pytest.fixture
def faked_cuda_on_cpu(monkeypatch):
    """torch.cuda's timing calls on the CPU (host clock events, no spin) and two small prefill shapes, so that the
    bench's bookkeeping runs here: hybridkv's entry runs its pure-torch reference on CPU tensors. Each name is
    patched in the module that looks it up (`run` calls the `_copy_gbps` that bench.py imported)."""
    torch = pytest.importorskip("torch")
    import time

    from hybridkv.benchmarks.gdn import command as bench
    from hybridkv.benchmarks.gdn import cases as bench_cases
    from hybridkv.benchmarks.gdn import timing as bench_timing

    class Event:
        def __init__(self, enable_timing: bool = False):
            self.t = 0.0

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "faked CPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench_cases, "DEVICE", "cpu")
    monkeypatch.setattr(bench_timing, "_ms_per_mcycle", lambda: 1.0)
    monkeypatch.setattr(bench, "_copy_gbps", lambda iters: 1000.0)
    monkeypatch.setattr(bench_timing, "B2B_CALLS", 2)
    monkeypatch.setattr(bench_timing, "_flush_bytes", lambda: 1 << 16)
    monkeypatch.setattr("hybridkv.benchmarks.gdn.rows._flush_bytes", lambda: 1 << 16)
    monkeypatch.setattr(bench_cases, "PREFILL_SHAPES",
                        (bench_cases.PrefillShape(model="tiny", H=1, HV=2, lens=(70,)),
                         bench_cases.PrefillShape(model="tiny", H=1, HV=2, lens=(40, 30))))
    return bench


def test_timed_calls_interleave_round_by_round_faked_cuda_on_cpu(faked_cuda_on_cpu):
    from hybridkv.benchmarks.gdn import timing as bench_timing

    log: list[str] = []
    fns = {name: (lambda name=name: log.append(name)) for name in ("a", "b", "c")}
    timed = bench_timing._interleaved(fns, iters=4)
    assert set(timed) == {"a", "b", "c"}
    warm = 3 + 5  # warm-up calls and host timing, one implementation after the other
    assert log[:3 * warm] == ["a"] * warm + ["b"] * warm + ["c"] * warm
    assert "".join(log[3 * warm:3 * warm + 12]) == "abcbcacababc"
    b2b = "".join(log[3 * warm + 12:])  # 2 calls back to back per turn, rounds rotated too
    assert b2b == "aabbccbbccaaccaabb"


def _bench_args(*args: str):
    import argparse

    from hybridkv.benchmarks.gdn import command as bench

    parser = argparse.ArgumentParser()
    bench.register(parser)
    return parser.parse_args(list(args))


def test_bench_checks_every_column_against_the_fp32_reference_faked_cuda_and_baselines(faked_cuda_on_cpu, monkeypatch,
                                                                                         tmp_path, capsys):
    import json

    import torch

    from hybridkv.kernels.gdn import chunk_gated_delta_rule
    from hybridkv.benchmarks.gdn import baselines
    from hybridkv.benchmarks.gdn import timing as bench_timing
    from hybridkv.benchmarks.gdn import warmup as bench_warmup
    from tests.kernels import flashinfer_contract

    bench = faked_cuda_on_cpu
    monkeypatch.setattr(bench_timing, "B2B_ROUNDS", 1)

    def broken_qla(q, k, v, g, beta, **kw):  # right shapes, wrong numbers; refuses varlen
        if kw["cu_seqlens"] is not None:
            raise RuntimeError("varlen is not supported here")
        o, state = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        return torch.zeros_like(o), state

    monkeypatch.setattr(baselines, "load_fla_chunk",
                        lambda: baselines.Loaded(name="fla", fn=chunk_gated_delta_rule, note="faked FLA"))
    monkeypatch.setattr(baselines, "load_fla_recurrent", lambda: None)
    monkeypatch.setattr(baselines, "load_flash_qla",
                        lambda: baselines.Loaded(name="flash_qla", fn=broken_qla, note="faked FlashQLA"))
    # FlashInfer's column through the real argument mapping, into a stand-in keeping FlashInfer's documented contract.
    fi = baselines.flashinfer_call(flashinfer_contract.chunk_gated_delta_rule)
    monkeypatch.setattr(baselines, "load_flashinfer",
                        lambda: baselines.Loaded(name="flashinfer", fn=fi, note="faked FlashInfer"))
    out = tmp_path / "bench.json"
    assert bench.run(_bench_args("--only", "prefill", "--iters", "3", "--warm-jobs", "0",
                                 "--json-file", str(out))) == 0
    blob = json.loads(out.read_text())
    assert blob["fla"] and blob["flash_qla"] and blob["flash_qla_note"] == "faked FlashQLA"
    assert blob["flashinfer"] and blob["flashinfer_note"] == "faked FlashInfer"
    one, varlen = blob["rows"]
    assert (one["shape"], varlen["shape"]) == ("tiny H=1 HV=2 1x70", "tiny H=1 HV=2 varlen 40,30")
    # hybridkv and "FLA" here are the reference rounded to bf16: small errors, not zero (the reference is fp32).
    for key in ("err", "fla_err", "fi_err"):
        assert 0 < one[key] < 0.05 and 0 < varlen[key] < 0.05
    assert one["state_err"] < 1e-5 and one["fla_state_err"] < 1e-5 and one["fi_state_err"] < 1e-4
    # A wrong output shows as a large error, and a failing call as an empty column with its reason.
    assert one["qla_err"] > 10 * one["fla_err"] and one["qla_ms"] is not None and one["speedup_vs_qla"] is not None
    assert varlen["qla_ms"] is None and varlen["qla_err"] is None and varlen["speedup_vs_qla"] is None
    assert varlen["notes"] == ["FlashQLA: RuntimeError: varlen is not supported here"]
    assert all(r[k] is not None for r in (one, varlen) for k in ("ms", "fla_ms", "fi_ms", "b2b_ms", "fla_b2b_ms",
                                                                  "fi_b2b_ms", "first_call_s", "fla_first_call_s",
                                                                  "fi_first_call_s", "speedup_vs_fi"))
    assert blob["first_calls"] == "in this process"
    table = capsys.readouterr().out
    assert table.startswith("faked CPU; device copy 1000 GB/s; FLA: faked FLA; FlashQLA: faked FlashQLA; FlashInfer: "
                            "faked FlashInfer; first calls in this process")
    varlen_line = next(line for line in table.splitlines() if line.startswith("prefill  tiny H=1 HV=2 varlen"))
    assert varlen_line.split()[9:11] == ["-", "-"]  # QLA ms, x QLA
    assert float(varlen_line.split()[11]) == pytest.approx(varlen["fi_ms"], abs=1e-3)  # FI ms
    assert "  tiny H=1 HV=2 varlen 40,30: FlashQLA: RuntimeError: varlen is not supported here" in table
    # A warm-up process reports the same in the one JSON line `_warm_parallel` reads.
    assert bench_warmup._warm_main(["1", "hybridkv", "flash_qla"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["index"] == 1 and set(line["first_call_s"]) == {"hybridkv"}
    assert line["failed"] == {"flash_qla": "FlashQLA: RuntimeError: varlen is not supported here"}


def test_bench_without_flash_qla_shows_its_columns_empty_faked_cuda(faked_cuda_on_cpu, monkeypatch, capsys):
    import json

    from hybridkv.benchmarks.gdn import baselines
    from hybridkv.benchmarks.gdn import rows as bench_rows
    from hybridkv.benchmarks.gdn import timing as bench_timing

    bench = faked_cuda_on_cpu
    monkeypatch.setattr(bench_timing, "B2B_ROUNDS", 1)
    monkeypatch.setattr(baselines, "load_fla_chunk",
                        lambda: baselines.Loaded(name="fla", fn=None, note="not installed (No module named 'fla')"))
    monkeypatch.setitem(sys.modules, "flash_qla", None)
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert bench.run(_bench_args("--only", "prefill", "--iters", "2", "--json")) == 0
    blob = json.loads(capsys.readouterr().out)
    assert not blob["fla"] and not blob["flash_qla"] and not blob["flashinfer"]
    assert blob["flash_qla_note"].startswith("not installed (ModuleNotFoundError")
    assert blob["flashinfer_note"].startswith("not installed (ModuleNotFoundError")
    for r in blob["rows"]:
        assert r["err"] is not None and r["ms"] > 0
        assert all(r[k] is None for k in ("fla_ms", "qla_ms", "fi_ms", "fla_err", "qla_err", "fi_err",
                                          "speedup_vs_fla", "speedup_vs_qla", "speedup_vs_fi", "qla_first_call_s",
                                          "fi_first_call_s"))
    derived = ("speedup_vs_fla", "speedup_vs_qla", "speedup_vs_fi", "notes")
    row = bench_rows.Row(**{k: v for k, v in blob["rows"][0].items() if k not in derived})
    text = bench.render("header", [row], {})
    line = next(line for line in text.splitlines() if line.startswith("prefill  tiny"))
    assert line.split()[6:12] == ["-"] * 6  # FLA ms, x FLA, QLA ms, x QLA, FI ms, x FI


def test_warm_up_processes_feed_first_call_times_faked_subprocesses(monkeypatch):
    import subprocess

    from hybridkv.benchmarks.gdn import cases as bench_cases
    from hybridkv.benchmarks.gdn import warmup as bench_warmup

    class Proc:
        def __init__(self, cmd, **kw):
            assert cmd[1:4] == ["-m", "hybridkv.benchmarks.gdn.warmup", cmd[3]]
            self.index = int(cmd[3])
            self.returncode = 0 if self.index != 2 else 1

        def communicate(self, timeout=None):
            if self.index == 1 and timeout is not None:
                raise subprocess.TimeoutExpired("bench", timeout)
            if self.index == 0:
                return ('tilelang says hi\n{"index": 0, "first_call_s": {"hybridkv": 1.5, "flash_qla": 41.0}, '
                        '"failed": {"fla": "FLA: boom"}}\n', "")
            return "", "Traceback\nImportError: libz3.so.4.15"

        def kill(self):
            self.killed = True

    monkeypatch.setattr(subprocess, "Popen", Proc)
    shapes = tuple(enumerate(bench_cases.PREFILL_SHAPES[:3]))
    warmed = bench_warmup._warm_parallel(shapes, ["hybridkv", "fla", "flash_qla"], jobs=3, timeout=5.0)
    assert warmed.first_call_s == {(0, "hybridkv"): 1.5, (0, "flash_qla"): 41.0}
    # A warm-up that hung or died costs FlashQLA its column on that shape (it would compile in the timed process);
    # hybridkv and FLA compile in seconds there.
    assert warmed.failed == {(0, "fla"): "FLA: boom",
                             (1, "flash_qla"): "FlashQLA: warm-up did not finish in 5 s",
                             (2, "flash_qla"): "FlashQLA: warm-up exited 1: Traceback | ImportError: libz3.so.4.15"}


def test_a_charged_time_at_or_below_zero_leaves_the_column_empty():
    from hybridkv.benchmarks.gdn import rows as bench_rows

    assert bench_rows._pct_of_copy(1_000_000, 0.0, 1000.0) is None
    assert bench_rows._pct_of_copy(1_000_000, -0.001, 1000.0) is None
    assert bench_rows._pct_of_copy(1_000_000, 0.002, 1000.0) == pytest.approx(50.0)


def test_decode_rows_check_hybridkv_and_flashinfer_against_the_reference_faked_cuda_and_baselines(
        faked_cuda_on_cpu, monkeypatch, capsys):
    """The decode rows' bookkeeping on the CPU: hybridkv's step (here the reference rounded to bf16, standing in for the
    Triton kernel, which needs a GPU) and FlashInfer's (the contract stand-in through the real argument mapping) each
    run on their own copy of the pool and are checked against the fp32 reference; a baseline that refuses a shape
    leaves its column empty with the reason."""
    import json

    import torch

    from hybridkv.benchmarks.gdn import baselines
    from hybridkv.benchmarks.gdn import cases as bench_cases
    from hybridkv.kernels.gdn import naive as reference
    from tests.kernels import flashinfer_contract

    bench = faked_cuda_on_cpu
    monkeypatch.setattr(bench_cases, "DECODE_SHAPES", (("tiny", 1, 2),))
    monkeypatch.setattr(bench_cases, "DECODE_BATCHES", (3,))

    def ours(q, k, v, a, b, A_log, dt_bias, pool, idx):
        return reference.decode_reference(q, k, v, a, b, A_log, dt_bias, pool, idx, 128**-0.5, True, True)

    monkeypatch.setattr("hybridkv.kernels.gdn.gated_delta_rule_decode", ours)
    mapped = baselines.flashinfer_decode_call(flashinfer_contract.gated_delta_rule_decode_pretranspose)

    def fp32_only(q, k, v, a, b, A_log, dt_bias, pool, idx):
        if pool.dtype != torch.float32:
            raise RuntimeError("no kernel for this state dtype")
        return mapped(q, k, v, a, b, A_log, dt_bias, pool, idx)

    monkeypatch.setattr(baselines, "load_fla_recurrent", lambda: None)
    monkeypatch.setattr(baselines, "load_flashinfer_decode",
                        lambda: baselines.Loaded(name="flashinfer_decode", fn=fp32_only, note="faked decode"))
    assert bench.run(_bench_args("--only", "decode", "--iters", "2", "--json", "--pool", "vllm")) == 0
    blob = json.loads(capsys.readouterr().out)
    assert blob["flashinfer_decode"] and blob["flashinfer_decode_note"] == "faked decode"
    fp32, bf16 = blob["rows"]
    assert (fp32["shape"], bf16["shape"]) == ("tiny HV=2 B=3 float32 vllm", "tiny HV=2 B=3 bfloat16 vllm")
    # Each started from the same pool as the reference: bf16 output rounding only (a step from an already-updated
    # pool would be off by the size of the state, ~0.1).
    for r in (fp32, bf16):
        assert r["err"] < 2e-2 and r["state_err"] < (1e-5 if r is fp32 else 1e-2)
    assert fp32["fi_err"] < 2e-2 and fp32["fi_state_err"] < 1e-5 and fp32["fi_ms"] > 0
    assert fp32["fi_copy_pct"] > 0 and fp32["fi_copy_same_pct"] > 0 and fp32["speedup_vs_fi"] is not None
    assert bf16["fi_ms"] is None and bf16["fi_err"] is None and bf16["fi_copy_pct"] is None
    assert bf16["fi_copy_same_pct"] is None and all(r["copy_same_pct"] > 0 for r in (fp32, bf16))
    # The tuner's timing too, FlashInfer's where it ran (a difference of two medians: on the CPU's clock it can come out
    # at or below zero, which leaves the column empty rather than negative).
    assert all(r["charged_pct"] is None or r["charged_pct"] > 0 for r in (fp32, bf16))
    assert bf16["fi_charged_pct"] is None
    assert bf16["notes"] == ["FlashInfer: RuntimeError: no kernel for this state dtype"]
    derived = ("speedup_vs_fla", "speedup_vs_qla", "speedup_vs_fi", "notes")
    rows = [bench_rows_row(r, derived) for r in (fp32, bf16)]
    text = bench.render("header", rows, {})
    assert "decode: max |error| vs the fp32 reference" in text
    line = next(line for line in text.splitlines() if line.startswith("tiny HV=2 B=3 bfloat16 vllm "))
    assert line.split()[6] == line.split()[8] == "-"  # FlashInfer's output and state errors (after hybridkv's)
    assert "  tiny HV=2 B=3 bfloat16 vllm: FlashInfer: RuntimeError: no kernel for this state dtype" in text


def bench_rows_row(blob_row: dict, derived: tuple[str, ...]):
    from hybridkv.benchmarks.gdn import rows as bench_rows

    return bench_rows.Row(**{k: (tuple(v) if k == "notes" else v) for k, v in blob_row.items() if k not in derived
                             or k == "notes"})
