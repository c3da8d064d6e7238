"""CPU: a chunked call cut into groups of sequences (`seq_groups.by_groups`, for batches whose (sequence, value head)
pairs would overflow a CUDA grid axis) returns exactly what the whole call returns, packed or batched, with initial
and final states, an empty sequence among them."""

from __future__ import annotations

import torch

from hybridkv.kernels.gdn import seq_groups
from hybridkv.kernels.gdn import naive as reference


def _inputs(B, T, H=2, HV=4, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, D, generator=gen)
    v = torch.randn(B, T, HV, D, generator=gen)
    g = -torch.rand(B, T, HV, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    return q, k, v, g, beta


def _counting(fn):
    calls = []

    def wrapped(*args, **kw):
        calls.append(args[8])
        return fn(*args, **kw)

    return wrapped, calls


def test_packed_sequences_in_groups_equal_the_whole_call():
    lens = [5, 0, 9, 3, 7]  # an empty sequence in the middle of a group
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q, k, v, g, beta = _inputs(1, int(cu[-1]))
    h0 = torch.randn(len(lens), 4, 16, 16)
    whole = reference.chunk_reference(q, k, v, g, beta, 0.25, h0, True, cu, True, False)
    fn, calls = _counting(reference.chunk_reference)
    # limit 8 with HV = 4: two sequences a group, so three calls
    split = seq_groups.by_groups(fn, q, k, v, g, beta, 0.25, h0, True, cu, True, False, limit=8)
    assert [c.tolist() for c in calls] == [[0, 5, 5], [0, 9, 12], [0, 7]]
    assert torch.equal(split[0], whole[0]) and torch.equal(split[1], whole[1])


def test_batched_sequences_in_groups_equal_the_whole_call():
    q, k, v, g, beta = _inputs(5, 6, seed=1)
    whole = reference.chunk_reference(q, k, v, g, beta, 0.25, None, True, None, False, True)
    fn, calls = _counting(reference.chunk_reference)
    split = seq_groups.by_groups(fn, q, k, v, g, beta, 0.25, None, True, None, False, True, limit=8)
    assert len(calls) == 3
    assert torch.equal(split[0], whole[0]) and torch.equal(split[1], whole[1])
    no_state = seq_groups.by_groups(reference.chunk_reference, q, k, v, g, beta, 0.25, None, False, None, False, True,
                                    limit=8)
    assert no_state[1] is None and torch.equal(no_state[0], whole[0])


def test_a_call_within_the_limit_is_passed_through_once():
    q, k, v, g, beta = _inputs(3, 4, seed=2)
    fn, calls = _counting(reference.chunk_reference)
    seq_groups.by_groups(fn, q, k, v, g, beta, 0.25, None, False, None, False, False)
    assert len(calls) == 1
