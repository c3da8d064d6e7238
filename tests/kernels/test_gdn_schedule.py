"""CPU: which schedule a chunked call takes, and the errors a bad schedule request gets (no GPU needed:
both are decided before any kernel is launched)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from hybridkv.kernels.gdn import chunk_plan  # noqa: E402
from hybridkv.kernels.gdn import chunk as tc  # noqa: E402


SCORES, FUSED = tc.Form.SCORES, tc.Form.FUSED
PIPELINED, SERIAL, SCAN = tc.Schedule.PIPELINED, tc.Schedule.SERIAL, tc.Schedule.SCAN


@pytest.mark.parametrize(("N", "HV", "want"), [
    (1, 32, (SCORES, PIPELINED, (32, 4, 3))),  # 35B, one sequence: 128 programs on 132 SMs
    (1, 16, (SCORES, SCAN, (64, 4, 3))),  # 2B, 35B at TP2: half the SMs idle; BV=64 lets four segments fit
    (1, 8, (SCORES, SCAN, (64, 4, 3))),  # 397B at TP8: BV=64 lets eight segments fit (four at BV=32)
    (1, 4, (SCORES, SCAN, (32, 4, 3))),  # 35B at TP8
    (1, 64, (SCORES, SERIAL, (64, 4, 3))),  # 397B: 128 programs at BV=64 (pipelining measured no gain)
    (1, 132, (FUSED, SERIAL, None)),  # 264 programs even at BV=64
    (2, 32, (FUSED, SERIAL, None)),  # a batch: the scores form was measured on one sequence only
    (4, 32, (FUSED, SERIAL, None)),
    (2, 16, (FUSED, PIPELINED, (32, 4, 3))),  # few sequences and heads still pipeline, fused
    (33, 1, (FUSED, PIPELINED, (32, 4, 3))),
    (34, 1, (FUSED, SERIAL, None)),
])
def test_the_plan_follows_how_many_chain_programs_fill_the_sms(N, HV, want):
    p = chunk_plan.plan(N, HV, 128, 128, 132, 128)
    assert (p.form, p.schedule, p.config) == want


@pytest.mark.parametrize(("N", "HV", "per_key", "form"), [
    (34, 1, 1, FUSED), (8, 16, 1, FUSED),  # one value head per key head: no q k^T to share
    (2, 32, 2, SCORES), (4, 32, 2, SCORES), (4, 32, 3, SCORES),  # 35B-shaped: P made beside the inverse pays
    (4, 64, 4, SCORES), (16, 64, 4, SCORES), (4, 64, 8, SCORES),  # 397B-shaped
])
def test_batches_the_triton_chain_would_take_autotuned_run_the_gluon_chain_where_it_can(N, HV, per_key, form):
    p = chunk_plan.plan(N, HV, 128, 128, 132, 128, gluon=True, heads_per_key=per_key)
    assert p == chunk_plan.Plan(form=form, schedule=SERIAL, config=None, gluon_chain=True)
    # where it cannot: Triton's chain, fused (its scores form was slower on batches)
    assert chunk_plan.plan(N, HV, 128, 128, 132, 128, heads_per_key=per_key) == chunk_plan.Plan(
        form=FUSED, schedule=SERIAL, config=None)
    # a form the caller fixed is kept
    assert chunk_plan.plan(N, HV, 128, 128, 132, 128, form=SCORES, gluon=True).form is SCORES
    assert chunk_plan.plan(N, HV, 128, 128, 132, 128, form=FUSED, gluon=True).form is FUSED


@pytest.mark.parametrize(("N", "HV", "chunks", "form"), [
    (1, 132, 128, None), (1, 8, 128, None), (1, 32, 128, None),  # prompts planned other than serial at BV=64
    (2, 16, 128, None), (33, 1, 128, None),  # pipelined batches too
    (4, 32, chunk_plan.PIPELINE_MIN_CHUNKS - 1, None),  # short batches: not measured
])
def test_the_gluon_chain_is_planned_for_long_fused_batches_and_serial_prompts_only(N, HV, chunks, form):
    assert not chunk_plan.plan(N, HV, 128, 128, 132, chunks, form=form, gluon=True).gluon_chain


def test_a_prompt_of_many_value_heads_runs_its_scores_form_on_the_gluon_chain_where_it_can():
    """397B-shaped heads, one prompt: serial at BV=64 in the scores form, the chain in Gluon loading P."""
    p = chunk_plan.plan(1, 64, 128, 128, 132, 128, gluon=True)
    assert p == chunk_plan.Plan(form=SCORES, schedule=SERIAL, config=chunk_plan.ONE_PER_SM_CONFIG,
                                gluon_chain=True)
    assert not chunk_plan.plan(1, 64, 128, 128, 132, 128).gluon_chain


def test_four_byte_inputs_pipeline_at_two_stages_and_skip_the_bv64_plan():
    """fp32 q, k, v: three stages would need 243.5 KB of shared memory (over 227 KB per program), and the
    scores form at BV=64 241 KB even at two (tests/kernels/test_compile_report.py holds both)."""
    assert chunk_plan.plan(1, 32, 128, 128, 132, 128, itemsize=4).config == (32, 4, 2)
    assert chunk_plan.plan(1, 32, 128, 128, 132, 128, itemsize=2).config == (32, 4, 3)
    assert chunk_plan.plan(1, 64, 128, 128, 132, 128, itemsize=4) == chunk_plan.Plan(form=FUSED, schedule=SERIAL, config=None)


def test_a_scan_needs_two_segments_of_chunks_and_one_sequence():
    floor = max(chunk_plan.PIPELINE_MIN_CHUNKS, 2 * chunk_plan.SCAN_MIN_SEGMENT_CHUNKS)
    assert chunk_plan.plan(1, 8, 128, 128, 132, floor).schedule is SCAN
    assert chunk_plan.plan(1, 8, 128, 128, 132, floor - 1).schedule is not SCAN
    assert chunk_plan.plan(2, 8, 128, 128, 132, 128).schedule is PIPELINED


def test_a_wide_scan_plan_is_for_two_byte_inputs_only():
    """fp32 inputs: the scores form at BV=64 does not fit shared memory (see the test below)."""
    assert chunk_plan.plan(1, 16, 128, 128, 132, 128, itemsize=4).config == (32, 4, 2)
    assert chunk_plan.plan(1, 8, 128, 128, 132, 128, itemsize=4).config == (32, 4, 2)


def test_scan_segments_fill_one_wave_of_the_output_chain():
    assert chunk_plan.scan_segments(32, 132, 128) == 4  # 32 chain programs (397B TP8 at BV=32)
    assert chunk_plan.scan_segments(16, 132, 128) == chunk_plan.SCAN_MAX_SEGMENTS  # 397B TP8 at BV=64
    assert chunk_plan.scan_segments(32, 132, 16) == 2  # two segments of the minimum length
    assert chunk_plan.scan_segments(100, 132, 128) == 2  # never fewer than two


def test_a_short_prompt_stays_serial_and_autotuned():
    fused = chunk_plan.Plan(form=FUSED, schedule=SERIAL, config=None)
    assert chunk_plan.plan(1, 32, 128, 128, 132, chunk_plan.PIPELINE_MIN_CHUNKS - 1) == fused
    assert chunk_plan.plan(1, 64, 128, 128, 132, chunk_plan.PIPELINE_MIN_CHUNKS - 1) == fused
    assert chunk_plan.plan(1, 32, 128, 128, 132, chunk_plan.PIPELINE_MIN_CHUNKS).schedule is PIPELINED


def test_key_heads_over_128_are_autotuned():
    """The fixed configs were measured (and fit shared memory) at K = 128 only."""
    fused = chunk_plan.Plan(form=FUSED, schedule=SERIAL, config=None)
    assert chunk_plan.plan(1, 32, 256, 128, 132, 128) == fused
    assert chunk_plan.plan(1, 64, 256, 128, 132, 128) == fused


def test_the_callers_form_is_kept():
    assert chunk_plan.plan(1, 32, 128, 128, 132, 128, form=FUSED) == chunk_plan.Plan(form=FUSED, schedule=PIPELINED,
                                                                      config=(32, 4, 3))
    assert chunk_plan.plan(1, 64, 128, 128, 132, 128, form=FUSED) == chunk_plan.Plan(form=FUSED, schedule=SERIAL, config=None)
    assert chunk_plan.plan(4, 32, 128, 128, 132, 128, form=SCORES) == chunk_plan.Plan(form=SCORES, schedule=SERIAL, config=None)


def _inputs(T=200, H=2, HV=4):
    q = torch.randn(1, T, H, 128, dtype=torch.bfloat16)
    v = torch.randn(1, T, HV, 128, dtype=torch.bfloat16)
    return q, q.clone(), v, torch.zeros(1, T, HV), torch.ones(1, T, HV)


def test_a_form_that_is_not_a_form_is_refused_with_its_value():
    q, k, v, g, beta = _inputs()
    with pytest.raises(ValueError, match="form must be a Form .*got 'scores'"):
        tc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, 0.1, None, True, None, True, False, form="scores")


def test_a_bad_form_is_refused_before_an_empty_call_returns():
    q, k, v, g, beta = _inputs(T=0)
    with pytest.raises(ValueError, match="form must be a Form"):
        tc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, 0.1, None, True, None, True, False, form=1)


def test_a_pipelined_call_needs_a_config():
    q, k, v, g, beta = _inputs()
    with pytest.raises(ValueError, match="schedule pipelined needs a fixed state config"):
        tc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, 0.1, None, False, None, True, False,
                                      schedule=tc.Schedule.PIPELINED)


@pytest.mark.parametrize("segments", [0, -3])
def test_segments_must_be_positive(segments):
    q, k, v, g, beta = _inputs()
    with pytest.raises(ValueError, match=f"segments must be >= 1, got {segments}"):
        tc.chunk_gated_delta_rule_fwd(q, k, v, g, beta, 0.1, None, False, None, True, False, config=(32, 4, 3),
                                      schedule=tc.Schedule.PIPELINED, segments=segments)


@pytest.mark.parametrize(("group", "H", "HV", "want"), [
    (4, 16, 64, 4),  # 397B: a program per key head
    (4, 16, 32, 2),  # 35B
    (4, 16, 48, 3),  # 27B: three value heads per key head
    (4, 2, 10, 1),  # five per key head: 5 has no divisor in 2..4
    (1, 16, 64, 1),
    (4, 16, 16, 1),
])
def test_inverse_groups_value_heads_of_one_key_head(group, H, HV, want):
    from hybridkv.kernels.gdn.inverse import InverseConfig

    got = InverseConfig(group=group).group_for(H, HV)
    assert got == want and (HV // H) % got == 0


@pytest.mark.parametrize(("bad", "match"), [(dict(group=0), "group must be an int >= 1, got 0"),
                                            (dict(gluon=1), "gluon must be a bool, got 1")])
def test_a_bad_inverse_config_is_refused_with_its_values(bad, match):
    from hybridkv.kernels.gdn.inverse import InverseConfig

    with pytest.raises(ValueError, match=match):
        InverseConfig(**bad)


@pytest.mark.parametrize(("device", "capability", "dtype", "K", "gluon"), [
    ("cuda", (9, 0), "torch.bfloat16", 128, True),
    ("cuda", (9, 0), "torch.float16", 256, True),
    ("cuda", (9, 0), "torch.bfloat16", 96, True),
    ("cuda", (9, 0), "torch.float32", 128, False),  # its gram takes 16-bit operands
    ("cuda", (9, 0), "torch.bfloat16", 80, False),  # 32 columns of k per gram step
    ("cuda", (8, 0), "torch.bfloat16", 128, False),  # measured on sm_90 only
    ("cuda", (10, 0), "torch.bfloat16", 128, False),
    ("cpu", None, "torch.bfloat16", 128, False),  # no Gluon interpreter: CI's path stays the Triton kernel
])
def test_the_default_inverse_is_the_gluon_kernel_on_hopper_only(device, capability, dtype, K, gluon):
    from hybridkv.kernels.gdn.inverse import GLUON_INVERSE_CONFIG, INVERSE_CONFIG, default_inverse

    got = default_inverse(device, capability, dtype, K)
    assert got == (GLUON_INVERSE_CONFIG if gluon else INVERSE_CONFIG)
    assert got.gluon == gluon
    # A Triton whose Gluon lacks what the kernel uses (older than the 3.6 it was written against): Triton's kernel.
    assert default_inverse(device, capability, dtype, K, gluon_ready=False) == INVERSE_CONFIG


@pytest.mark.parametrize(("change", "fits"), [
    ({}, True),
    ({"capability": (8, 0)}, False), ({"capability": (10, 0)}, False), ({"capability": None}, False),  # wgmma: sm_90
    ({"dtype": "torch.float16"}, False), ({"dtype": "torch.float32"}, False),  # its TMA boxes and GEMMs are bf16
    ({"K": 64}, False), ({"V": 256}, False),  # written for K = V = 128
    ({"gluon_ready": False}, False),
])
def test_only_bf16_calls_on_hopper_may_be_planned_onto_the_gluon_chain(change, fits):
    base = dict(capability=(9, 0), dtype="torch.bfloat16", K=128, V=128, gluon_ready=True)
    assert chunk_plan.gluon_chain_fits(**{**base, **change}) is fits


def test_this_triton_has_what_the_gluon_kernels_use():
    """CI's Triton (the pinned one) must keep the Gluon path: without it Hopper would quietly lose both kernels."""
    assert tc.gluon_ready()


def test_the_gluon_inverse_is_refused_where_it_cannot_run_faked_cuda_tensor():
    """`InverseConfig(gluon=True)` on the CPU (Gluon has no interpreter) or with fp32 inputs (its gram takes 16-bit
    operands): a ValueError naming the value, before any kernel runs."""
    import dataclasses

    from hybridkv.kernels.gdn.inverse import GLUON_INVERSE_CONFIG as inverse
    q = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    v = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    g, beta = torch.zeros(1, 64, 2), torch.zeros(1, 64, 2)
    with pytest.raises(ValueError, match="the Gluon inverse runs on a CUDA GPU only, got q on cpu"):
        tc.chunk_gated_delta_rule_fwd(q, q, v, g, beta, 1.0, None, False, None, True, False, inverse=inverse)
    from hybridkv.kernels.gdn.gluon import inverse as gluon_chunk_inverse

    class Cuda:  # only the attributes `launch` reads before it refuses
        is_cuda, dtype, shape = True, torch.float32, (1, 64, 1, 128)

    with pytest.raises(ValueError, match="takes bf16 or fp16 q and k, got torch.float32 and torch.float32"):
        gluon_chunk_inverse.launch(Cuda(), Cuda(), g, beta, None, None, None, None, None, 1, 1.0, True)


def test_the_gluon_chain_is_refused_where_it_cannot_run():
    """`gluon_chain=True` outside what it was written for (serial calls on a CUDA GPU) or not a bool: a ValueError
    naming the value, before any kernel runs."""
    q = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    v = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    g, beta = torch.zeros(1, 64, 2), torch.zeros(1, 64, 2)
    args = (q, q, v, g, beta, 1.0, None, False, None, True, False)
    with pytest.raises(ValueError, match="the Gluon chain runs serial calls, got schedule pipelined"):
        tc.chunk_gated_delta_rule_fwd(*args, gluon_chain=True, schedule=PIPELINED, config=(32, 4, 3))
    with pytest.raises(ValueError, match="the Gluon chain runs on a CUDA GPU only, got q on cpu"):
        tc.chunk_gated_delta_rule_fwd(*args, gluon_chain=True)
    with pytest.raises(ValueError, match="gluon_chain must be True, False or None, got 1"):
        tc.chunk_gated_delta_rule_fwd(*args, gluon_chain=1)
    with pytest.raises(ValueError, match="inverse must be an InverseConfig or None, got 'gluon'"):
        tc.chunk_gated_delta_rule_fwd(*args, inverse="gluon")


def test_the_summaries_follow_a_wide_output_chain_where_heads_are_few():
    """397B TP8 (8 value heads): the output chain at BV=64 over eight segments, and the summaries at BV=64 beside it;
    more heads keep the many-heads summary, a BV=32 chain the few-heads one."""
    from hybridkv.kernels.gdn import chunk_scan as triton_chunk_scan

    p = chunk_plan.plan(1, 8, 128, 128, 132, 128)
    assert chunk_plan.scan_segments(128 // p.config[0] * 8, 132, 128) == 8
    wide = triton_chunk_scan.SUMMARY_WIDE_FEW_HEADS_CONFIG
    assert triton_chunk_scan.summary_config(8, p.config[0]) == wide == (64, 4, 3)
    assert triton_chunk_scan.summary_config(4, 32) == triton_chunk_scan.SUMMARY_FEW_HEADS_CONFIG
    assert triton_chunk_scan.summary_config(16, 64) == triton_chunk_scan.SUMMARY_MANY_HEADS


def test_programmatic_dependent_launches_are_for_cuda_gpus_only(monkeypatch):
    """`pdl.enabled`: never on the CPU (the interpreter runs the kernels' PDL branch off), and never when switched off
    or when this Triton lacks griddepcontrol.wait."""
    from hybridkv.kernels.gdn import pdl

    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.gdc_wait is not None  # the pinned Triton has it: Hopper calls would otherwise lose it quietly
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.enabled(torch.device("cuda", 0))  # decided before the device is asked


def test_qkv_by_tma_is_refused_where_a_stage_of_v_would_be_misaligned():
    """`QKV.TMA` stages a v row of BV elements per tile: BV 32 of bf16 is 64 bytes, which would misalign every other
    stage (the Gluon ring walk faulted so on an H200), so the launch is refused with the value before any kernel; and a
    qkv that is not a `QKV` is refused with its value."""
    from hybridkv.kernels.gdn import decode_tma as triton_decode_tma

    q, k = torch.zeros(4, 2, 128, dtype=torch.bfloat16), torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    v = torch.zeros(4, 4, 128, dtype=torch.bfloat16)
    pool = torch.zeros(8, 4, 128, 128, dtype=torch.bfloat16)
    args = (q, k, v, None, None, None, None, None, pool, None, 1.0, True, 1.0, 20.0)
    with pytest.raises(ValueError, match="BV \\* 2 bytes to be a multiple of 128, got BV=32"):
        triton_decode_tma.launch((32, 4, 4, 3), *args, sms=1, qkv=triton_decode_tma.QKV.TMA)
    short = (torch.zeros(4, 2, 32, dtype=torch.bfloat16), torch.zeros(4, 2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="K \\* 2 bytes to be a multiple of 128, got K=32"):
        triton_decode_tma.launch((64, 4, 4, 3), *short, *args[2:], sms=1, qkv=triton_decode_tma.QKV.TMA)
    with pytest.raises(ValueError, match="qkv must be a decode_tma.QKV, got 'tma'"):
        triton_decode_tma.launch((64, 4, 4, 3), *args, sms=1, qkv="tma")
    odd = torch.zeros(4 * 2 * 128 + 1, dtype=torch.bfloat16)[1:].view(4, 2, 128)  # a 2-byte offset: no descriptor
    with pytest.raises(ValueError, match="needs q as \\[N, heads, D\\]"):
        triton_decode_tma.launch((64, 4, 4, 3), odd, *args[1:], sms=1, qkv=triton_decode_tma.QKV.TMA)


def test_qkv_by_tma_is_a_candidate_only_where_a_descriptor_takes_q_k_and_v():
    """The tuner offers `QKV.TMA` forms only where `qkv_describable` holds, and a call whose tensors it does not hold
    for takes the loads (same bits): contiguous rows with a 128-byte v row at the config's BV (capped at V), a
    16-byte aligned base, [N, heads, D]."""
    from hybridkv.kernels.gdn import decode_tma as triton_decode_tma

    q, k = torch.zeros(4, 2, 128, dtype=torch.bfloat16), torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    v = torch.zeros(4, 4, 128, dtype=torch.bfloat16)
    assert triton_decode_tma.qkv_describable((64, 4, 4, 3), q, k, v)
    assert not triton_decode_tma.qkv_describable((32, 4, 4, 3), q, k, v)  # a 64-byte v row
    assert not triton_decode_tma.qkv_describable((64, 4, 4, 3), q, k, v[..., :32].contiguous())  # BV capped at 32
    odd = torch.zeros(4 * 2 * 128 + 1, dtype=torch.bfloat16)[1:].view(4, 2, 128)  # a 2-byte offset
    assert not triton_decode_tma.qkv_describable((64, 4, 4, 3), odd, k, v)
    assert not triton_decode_tma.qkv_describable((64, 4, 4, 3), q, k, v.reshape(4, 512))
    q32, k32 = torch.zeros(4, 2, 32, dtype=torch.bfloat16), torch.zeros(4, 2, 32, dtype=torch.bfloat16)
    assert not triton_decode_tma.qkv_describable((64, 4, 4, 3), q32, k32, v)  # 64-byte q, k rows: faulted on an H200
    mixed = torch.zeros(4, 2 * 2 * 128 + 4 * 128, dtype=torch.bfloat16)  # vLLM's views of one projection
    views = mixed[:, :256].view(4, 2, 128), mixed[:, 256:512].view(4, 2, 128), mixed[:, 512:].view(4, 4, 128)
    assert triton_decode_tma.qkv_describable((64, 4, 4, 3), *views)
