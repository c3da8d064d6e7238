"""CPU: how the decode tuner chooses among its timings (`triton_recurrent.DecodeTimings`): the fastest charged time,
unless others lie within `DECODE_TIE` of it, in which case the fastest of those in the steady timing. The timings
themselves are a GPU test's (test_gdn_triton.py::test_decode_tuning_times_every_candidate_and_leaves_the_pool_alone)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

from hybridkv.kernels.gdn import decode_tune as tr  # noqa: E402
from hybridkv.kernels.gdn.decode_kernels import DecodeChoice, DecodeKernel  # noqa: E402
from hybridkv.kernels.gdn.decode_tune import DecodeTimings  # noqa: E402

WALK = DecodeChoice(kernel=DecodeKernel.TMA, cfg=(64, 4, 4, 3), qkv_tma=True)
PREFETCH = DecodeChoice(kernel=DecodeKernel.PREFETCH, cfg=(4, 128, 1))
TILE = DecodeChoice(kernel=DecodeKernel.TILE, cfg=(32, 4))


def test_a_clear_winner_of_the_charged_timing_is_kept_without_a_steady_timing():
    charged = {WALK: 0.0400, PREFETCH: 0.0450, TILE: 0.0500}
    assert tr.near_ties(charged) == [WALK]
    assert DecodeTimings(charged=charged, steady={}).pick() is WALK


def test_near_ties_are_decided_by_the_steady_timing():
    # The H200's figures at 35B bf16 with 64 sequences (results/tuner_probe_charged_h200.txt), in ms.
    charged = {WALK: 0.04019, PREFETCH: 0.04013, TILE: 0.0450}
    steady = {WALK: 0.04278, PREFETCH: 0.03965}
    assert tr.near_ties(charged) == [PREFETCH, WALK]
    assert DecodeTimings(charged=charged, steady=steady).pick() == PREFETCH
    # The steady timing decides even against the charged order: runs apart, the walk's charged time came out 2.5%
    # ahead of the loop's as well as behind it.
    charged = {WALK: 0.0392, PREFETCH: 0.0402}
    assert DecodeTimings(charged=charged, steady={WALK: 0.0426, PREFETCH: 0.0396}).pick() == PREFETCH


def test_the_tie_band_is_relative_to_the_best_time():
    edge = 0.1 * (1 + tr.DECODE_TIE)
    assert tr.near_ties({WALK: 0.1, PREFETCH: edge * 0.999, TILE: edge * 1.001}) == [WALK, PREFETCH]


def test_a_charged_time_at_or_below_zero_keeps_a_band_no_wider_than_its_magnitude():
    # A charged time is a difference of medians; on a step shorter than its noise it can be negative.
    assert tr.near_ties({WALK: -0.001, PREFETCH: -0.001 + 0.001 * tr.DECODE_TIE / 2, TILE: 0.0}) == [WALK, PREFETCH]
    assert tr.near_ties({WALK: 0.0, TILE: 1e-9}) == [WALK]


def test_a_near_tie_without_a_steady_time_is_refused_with_its_name():
    timings = DecodeTimings(charged={WALK: 0.040, PREFETCH: 0.040}, steady={WALK: 0.041})
    with pytest.raises(ValueError, match=r"prefetch \(4, 128, 1\)"):
        timings.pick()


def test_no_candidates_is_refused():
    with pytest.raises(ValueError, match="no decode candidates"):
        tr.near_ties({})


def test_an_l2_prefetching_config_is_refused_for_a_pool_it_cannot_address():
    """cp.async.bulk.prefetch faults on an address that is not 16-byte aligned and does not exist before sm_90: a
    config that asks L2 ahead is refused, naming the pool, before anything is launched (the tuner offers such configs
    only for pools the TMA walk can take, which asks as much)."""
    import torch

    from hybridkv.kernels.gdn import decode_prefetch as tp

    N, H, HV, K, V = 2, 1, 2, 16, 16
    q = k = torch.zeros(N, H, K, dtype=torch.bfloat16)
    v = o = torch.zeros(N, HV, V, dtype=torch.bfloat16)
    a = b = torch.zeros(N, HV)
    A_log = dt_bias = torch.zeros(HV)
    flat = torch.zeros(4 * HV * V * K + 1, dtype=torch.bfloat16)
    for pool in (flat[:-1].view(4, HV, V, K), flat[1:].view(4, HV, V, K)):  # a CPU pool; a 2-byte offset too
        assert not tp.l2_prefetchable(pool)
        with pytest.raises(ValueError, match=r"L2AHEAD=3 needs a pool on an sm_90\+ GPU .*base 0x[0-9a-f]+, strides"):
            tp.launch((16, 128, 4, 3), q, k, v, a, b, A_log, dt_bias, o, pool, torch.zeros(N, dtype=torch.int32),
                      K**-0.5, True, 1.0, 20.0)
    with pytest.raises(ValueError, match="L2AHEAD must be 0 .* got 2"):
        tp.launch((16, 128, 4, 2), q, k, v, a, b, A_log, dt_bias, o, flat[:-1].view(4, HV, V, K),
                  torch.zeros(N, dtype=torch.int32), K**-0.5, True, 1.0, 20.0)
