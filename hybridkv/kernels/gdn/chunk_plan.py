"""The prefill plan: how `chunk.chunk_gated_delta_rule_fwd` runs a call, picked from its shape (`plan`).

A plan is a form (what the state chain computes per chunk), a schedule (how the parallel kernels and the chain
share the GPU), a fixed state-kernel config or the autotuner's, and whether the Gluon chain runs it. Pure Python, so
the rule is tested without Triton or a GPU. docs/kernels.md explains the choices; the measurements behind the
constants are in docs/benchmarks/gdn.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Form(enum.Enum):
    """What runs on the chain."""

    FUSED = "fused"  # six GEMMs per chunk, the masked scores P made on the chain; nothing but T and row scales in HBM
    # P made in parallel (by the inverse kernel on Hopper, else `inverse._chunk_scores_kernel`; q k^T once per key
    # head) and loaded: five GEMMs per chunk on the chain, 4096 elements more HBM per chunk and value head.
    SCORES = "scores"


class Schedule(enum.Enum):
    """How the parallel kernels (the inverse, and the scores) and the chain of one call share the GPU."""

    SERIAL = "serial"  # the parallel kernels, then the chain
    # The chunks cut into segments: the parallel kernels of segment j + 1 run on the caller's stream while the chain
    # of segment j runs on a side stream, ordered by events only (no kernel spins on another's flags: CUDA does not
    # promise that kernels of two streams run at the same time).
    PIPELINED = "pipelined"
    # One sequence cut into segments whose chains run at the same time: a summary of each segment (`chunk_scan`), a
    # short scan over segments for their start states, then the state kernel over every segment at once. For one
    # sequence with few value heads (TP-sharded), whose chain alone would leave most SMs idle.
    SCAN = "scan"


# (BV, num_warps, num_stages) of the state kernel in a pipelined call. BV=32 gives about one chain program per SM for
# one sequence of 35B-shaped heads and leaves the rest of each SM to the parallel kernels; a call pipelines only where
# BV=32 gives no more chain programs than SMs. Three stages keep the next chunk's copies in flight while this one
# computes (at two, Triton's pipeliner waits for them at the top of every chunk).
PIPELINE_CONFIG = (32, 4, 3)
PIPELINE_SEGMENTS = 2  # more add launches and events without hiding more work
# The scores form's serial config where BV=64 gives one chain program per SM (397B-shaped heads, one sequence).
ONE_PER_SM_CONFIG = (64, 4, 3)
# Below this many chunk rows a call stays serial: a short prompt's inverse costs less than a second stream's
# launches and events (a chosen floor, not a measured crossover).
PIPELINE_MIN_CHUNKS = 32
# Segments of a scan call: at most this many, of at least this many chunks each.
SCAN_MAX_SEGMENTS = 8
SCAN_MIN_SEGMENT_CHUNKS = 8
# The scan's chain where BV=32 would leave room for fewer than SCAN_MAX_SEGMENTS segments in one wave (HV = 8 or 16):
# BV=64 halves its programs, so twice the segments fit, each half as long.
SCAN_WIDE_CONFIG = (64, 4, 3)
# Batches on the Gluon chain take the scores form where a key head has at least this many value heads: P's q k^T is
# made once per key head, so it costs least per value head there, and the chain loses a GEMM per chunk.
BATCH_SCORES_MIN_HEADS_PER_KEY = 2


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How a call runs: its form, schedule, fixed state config (None: the autotuner's) and whether the Gluon chain
    (`gluon.chain`) runs it instead of the Triton state kernel (serial calls only)."""

    form: Form
    schedule: Schedule
    config: tuple[int, int, int] | None
    gluon_chain: bool = False


def gluon_chain_fits(*, capability: tuple[int, int] | None, dtype: str, K: int, V: int, gluon_ready: bool) -> bool:
    """Whether a call may be planned onto the Gluon chain before its tensors are asked (`gluon.chain.refusal`:
    alignment, 32-bit row count): a Hopper GPU (wgmma), bf16 inputs with K = V = 128 (what it is written for), and a
    Triton whose Gluon has what its kernels use (``gluon_ready``). ``dtype``: q's, as ``str(torch dtype)``;
    ``capability``: the device's (major, minor), None off a GPU."""
    return (capability is not None and capability[0] == 9 and dtype == "torch.bfloat16"
            and (K, V) == (128, 128) and gluon_ready)


def plan(N: int, HV: int, K: int, V: int, sms: int, chunks: int, itemsize: int = 2,
          form: Form | None = None, *, gluon: bool = False, heads_per_key: int = 1) -> Plan:
    """The plan of a call whose caller fixed neither schedule nor config (``form``: None, or the caller's).

    One sequence whose chain programs at BV=32 fill at most half the SMs (TP-sharded heads) is scanned
    (`Schedule.SCAN`, scores form) where it has two segments' worth of chunks: at PIPELINE_CONFIG, or
    SCAN_WIDE_CONFIG where BV=32 leaves room for fewer than SCAN_MAX_SEGMENTS segments per wave (2-byte inputs).
    Where BV=32 gives no more chain programs than SMs (few sequences and value heads) and the call has
    PIPELINE_MIN_CHUNKS chunk rows, it is pipelined at PIPELINE_CONFIG. One sequence takes the scores
    form, there and where only BV=64 gives that few programs (397B: serial at ONE_PER_SM_CONFIG, on the Gluon chain
    where ``gluon`` says it can run the call); several sequences on the Triton chain keep the fused form (their chain
    is not the whole call). Elsewhere, and for short prompts, the fused form autotuned; but where ``gluon`` says the
    Gluon chain can run the call, several sequences run on it instead (serial): in the scores form where the caller
    asks for it or where ``heads_per_key`` (HV / H) is at least BATCH_SCORES_MIN_HEADS_PER_KEY, else fused. The fixed
    configs were tuned for, and fit shared memory at, K = 128 only, so larger key heads are autotuned (which skips
    configs that do not fit). ``itemsize``: of q, k, v; 4-byte inputs get two stages (three need 243.5 KB of shared
    memory, over Hopper's 227 KB per program) and no BV=64 plan (241 KB at two)."""
    autotuned = Plan(form=form or Form.FUSED, schedule=Schedule.SERIAL, config=None)
    if K > 128 or chunks < PIPELINE_MIN_CHUNKS:
        return autotuned
    scores = form is Form.SCORES or (form is None and N == 1)
    programs = _cdiv(V, PIPELINE_CONFIG[0]) * N * HV
    if N == 1 and 2 * programs <= sms and chunks >= 2 * SCAN_MIN_SEGMENT_CHUNKS:
        wide = SCAN_MAX_SEGMENTS * programs > sms and itemsize <= 2
        bv, warps, stages = SCAN_WIDE_CONFIG if wide else PIPELINE_CONFIG
        return Plan(form=Form.SCORES if scores else form or Form.FUSED, schedule=Schedule.SCAN,
                    config=(bv, warps, stages if itemsize <= 2 else min(stages, 2)))
    if programs <= sms:
        bv, warps, stages = PIPELINE_CONFIG
        return Plan(form=Form.SCORES if scores else form or Form.FUSED, schedule=Schedule.PIPELINED,
                    config=(bv, warps, stages if itemsize <= 2 else min(stages, 2)))
    if scores and itemsize <= 2 and _cdiv(V, 64) * N * HV <= sms:
        return Plan(form=Form.SCORES, schedule=Schedule.SERIAL, config=ONE_PER_SM_CONFIG, gluon_chain=gluon)
    if gluon and N > 1:
        batch_scores = form is Form.SCORES or (form is None and heads_per_key >= BATCH_SCORES_MIN_HEADS_PER_KEY)
        return Plan(form=Form.SCORES if batch_scores else Form.FUSED, schedule=Schedule.SERIAL, config=None,
                    gluon_chain=True)
    return autotuned


def scan_segments(programs: int, sms: int, chunks: int) -> int:
    """Segments of a scan call: as many as keep the output chain within one wave of the SMs, with at least
    SCAN_MIN_SEGMENT_CHUNKS chunks each, and at least two."""
    return max(2, min(sms // max(programs, 1), chunks // SCAN_MIN_SEGMENT_CHUNKS, SCAN_MAX_SEGMENTS))
