"""How a chunked GDN call runs (`triton_chunk.chunk_gated_delta_rule_fwd`): the chain's form, the schedule, the
fixed state configs and the rule that picks them from the call's shape (`plan`). Pure Python, so the rule is tested
without Triton or a GPU (tests/kernels/test_gdn_schedule.py); the numbers behind each constant are in
tools/gdn/README.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Form(enum.Enum):
    """What runs on the chain (`triton_chunk_wu`)."""

    FUSED = "fused"  # `_chunk_state_kernel`: six GEMMs per chunk, nothing but T and row scales in HBM
    # The same chain with the masked scores P made in parallel (the Gluon inverse's SCORES on Hopper, else
    # `_chunk_scores_kernel`: q k^T once per key head, not once per value head and V block) and loaded: five GEMMs
    # per chunk on the chain, 4096 elements of q's dtype more HBM per chunk and value head (written once, read once
    # per V block).
    SCORES = "scores"
    SPLIT = "split"  # W, Q', U, U' made in parallel; three GEMMs per chunk on the chain


class Schedule(enum.Enum):
    """How the parallel kernels (the inverse, and the scores or W/U by form) and the chain of one call
    share the GPU."""

    SERIAL = "serial"  # the parallel kernels, then the chain
    # The chunks cut into segments: the parallel kernels of segment j + 1 run on the caller's stream while
    # the state chain of segment j runs on a side stream, ordered by events only. No kernel waits on another
    # inside the GPU (spinning on per-chunk flags can hang: CUDA does not promise that kernels of two
    # streams run at the same time), so this is correct however the GPU schedules them.
    PIPELINED = "pipelined"
    # The chunks of every sequence cut into segments whose chains run at the same time: a summary of each
    # segment (its M and B, `triton_chunk_scan`), a short scan over segments for their start states, then
    # the state kernel over every segment at once. For one sequence with few value heads (TP-sharded),
    # whose chain is the whole call and leaves most SMs idle.
    SCAN = "scan"


@dataclass(frozen=True, kw_only=True)
class GluonChain:
    """The chain in Gluon (`gluon_chunk_chain`) instead of the Triton state kernel, and how it is launched:
    ``rows`` of the state's 128 value rows per program (128: eight warps hold the whole state; 64: four warps, two
    programs per head, twice the programs), ``overlap`` 0, 1 or 2 (its asynchronous-wgmma variants, OVERLAP),
    ``staged_scales``: each chunk's row scales arrive by TMA with its tiles instead of by pointer loads
    (STAGED_SCALES)."""

    overlap: int = 0
    rows: int = 128
    staged_scales: bool = False

    def __post_init__(self) -> None:
        if self.overlap not in (0, 1, 2) or self.rows not in (64, 128) or not isinstance(self.staged_scales, bool):
            raise ValueError(f"bad Gluon chain {self}: overlap 0, 1 or 2, rows 64 or 128 and staged_scales True or "
                             "False")


# (BV, num_warps, num_stages) of the state kernel in a pipelined call. BV=32 gives about one chain program
# per SM for one sequence of 35B-shaped heads (HV=32) and leaves the rest of each SM to the inverse and
# scores kernels. A call pipelines only where BV=32 gives no more chain programs than SMs: with more
# (397B-shaped heads, HV=64) the chain fills the GPU and pipelining gained nothing over serial.
# Three stages, not two: at two, Triton's pipeliner issues the next chunk's copies at the end of the
# current one and waits for them at the top of the next (async_wait num = 0 in the TTGIR; column `flight`
# of `hybridkv kernels report`), so every chunk waits out a global-load latency; at three the next chunk's
# copies stay in flight while this one computes. Batched calls keep two stages (autotuned): a third
# stage's shared memory (46-50 KB per program) costs programs per SM there.
# Two segments: more add launches and events without hiding more work. Pipelining hides less than the
# whole inverse and scores time, because those run more slowly beside a chain program (its registers leave
# room for two inverse programs on its SM instead of four).
PIPELINE_CONFIG = (32, 4, 3)
PIPELINE_SEGMENTS = 2
# The scores form's serial config where BV=64 gives one chain program per SM (397B-shaped heads, one
# sequence): the chain already fills the GPU, so pipelining does not pay, and three stages keep the next
# chunk's copies in flight as above. Four warps: eight were slower here.
ONE_PER_SM_CONFIG = (64, 4, 3)
# Below this many chunk rows a call stays serial: a short prompt's inverse takes a few microseconds, less
# than the second stream's launches and events cost (a chosen floor, not a measured crossover).
PIPELINE_MIN_CHUNKS = 32
# Segments of a scan call: at most this many, of at least this many chunks each (summaries, the scan and
# three launches cost a few microseconds; a segment of a few chunks hides less than that).
SCAN_MAX_SEGMENTS = 8
SCAN_MIN_SEGMENT_CHUNKS = 8
# The scan's output chain where BV=32 would leave room for fewer than SCAN_MAX_SEGMENTS segments in one wave
# (HV = 8 or 16 on 132 SMs): BV=64 halves its programs, so twice the segments fit, each half as long. H200, one
# 8192-token prompt, scores form (tools/gdn/scan_probe.py): HV=16 0.239 ms at (64, 4, 3) x4 against 0.274 at
# (32, 4, 3) x4 and 0.288 pipelined; HV=8 (397B TP8), with the summaries at BV=64 beside it
# (`triton_chunk_scan.summary_config`), 0.125 ms at (64, 4, 3) x8 against 0.141 at (32, 4, 3) x4 (1x32768: 0.379
# against 0.479); HV=4 (35B TP8), where BV=32 already gives eight segments, 0.092 at (32, 4, 3) x8 against 0.100
# (results/scan_probe4_h200.txt).
SCAN_WIDE_CONFIG = (64, 4, 3)


# The chain of batched calls where the Gluon chain can run them (Hopper, bf16, K = V = 128): half the state per
# program, its wgmmas in flight together. H200, serial calls, chain kernel alone against the Triton state kernel
# (tools/device/results/inverse_probe_cap_h200.txt): 397B 4x8192 1,117 -> 1,014 us, 35B 4x8192 574 -> 521;
# the whole-state Gluon chain was 3-6% faster than Triton there and 11-27% slower on one prompt, this one faster on
# every shape measured (also one prompt: 397B 1x8192 476 -> 402), but single prompts keep their own plans below,
# which beat both.
BATCH_GLUON_CHAIN = GluonChain(rows=64, overlap=1)
# Batches on BATCH_GLUON_CHAIN take the scores form (P made in parallel, loaded by TMA) where a key head has
# at least this many value heads: P's q k^T is made once per key head, so P costs least per value head
# there, and the chain loses a GEMM and its exponentials per chunk. H200, same run (results/scan_probe7_h200.txt):
# 397B (4 per key head) 4x8192 1.448 -> 1.357 ms (chain 1,018 -> 731 us, plus 201 us of scores), 16x2048 1.444 ->
# 1.365; 35B (2 per key head) 4x8192 0.795 -> 0.786 (chain 520 -> 376, scores 139), within noise, so it stayed fused
# until the inverse made P itself (`InverseConfig.scores`, 2026-12-03, seventh session): P then costs the inverse
# 77 us instead of the scores kernel's 138, and 35B 4x8192 in the scores form is 0.766 -> 0.703 ms, 16x2048 0.759 ->
# 0.709 (results/scan_probe9_scores_inverse_h200.txt). One value head per key head shares no q k^T: not measured,
# left fused.
BATCH_SCORES_MIN_HEADS_PER_KEY = 2
# The chain of one prompt planned serial at ONE_PER_SM_CONFIG (397B-shaped heads), where the Gluon chain can run it:
# the same half-state program, fed P by TMA (scores form; made by the scores kernel when this was measured, by the
# inverse since 2026-12-03) instead of making them on the chain.
# H200, same run, against the Triton scores chain it replaced (results/scan_probe6_prompt_gluon_h200.txt): 397B
# 1x8192 0.450 -> 0.435 ms, 1x32768 1.681 -> 1.638, the same error; at overlap 0, 0.444 and 1.670.
PROMPT_GLUON_CHAIN = GluonChain(rows=64, overlap=1)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How a call runs: its form, schedule, fixed state config (None: the autotuner's) and, for a serial call of the
    fused form, the Gluon chain that runs it instead of the Triton state kernel (None: Triton's)."""

    form: Form
    schedule: Schedule
    config: tuple[int, int, int] | None
    gluon_chain: GluonChain | None = None


def gluon_chain_fits(*, capability: tuple[int, int] | None, dtype: str, K: int, V: int, form: Form | None,
                     gluon_ready: bool) -> bool:
    """Whether a call may be planned onto the Gluon chain, before its tensors are asked (`gluon_chunk_chain.refusal`:
    alignment, 32-bit row count): a Hopper GPU (wgmma), bf16 inputs with K = V = 128 (what it is written for), a form
    the caller left open, fused or scores (it makes the scores itself or loads them; the split form's W/U it does not
    take), and a Triton whose Gluon has what its kernels use (``gluon_ready``). Which calls it is then planned for is
    `plan`'s rule. ``dtype``: q's, as ``str(torch dtype)``; ``capability``: the device's (major, minor), None off a
    GPU."""
    return (capability is not None and capability[0] == 9 and dtype == "torch.bfloat16"
            and (K, V) == (128, 128) and form in (None, Form.FUSED, Form.SCORES) and gluon_ready)


def plan(N: int, HV: int, K: int, V: int, sms: int, chunks: int, itemsize: int = 2,
          form: Form | None = None, *, gluon: bool = False, heads_per_key: int = 1) -> Plan:
    """The plan of a call whose caller fixed neither schedule nor config (``form``: None, or the caller's).

    One sequence whose chain programs at BV=32 fill at most half the SMs (TP-sharded heads) is scanned
    (`Schedule.SCAN`, scores form) where it has two segments' worth of chunks: at PIPELINE_CONFIG, or
    SCAN_WIDE_CONFIG where BV=32 leaves room for fewer than SCAN_MAX_SEGMENTS segments per wave (2-byte inputs).
    Where BV=32 gives no more chain programs than SMs (few sequences and value heads) and the call has
    PIPELINE_MIN_CHUNKS chunk rows, it is pipelined at PIPELINE_CONFIG. One sequence takes the scores
    form, there and where only BV=64 gives that few programs (397B: serial at ONE_PER_SM_CONFIG, and on
    PROMPT_GLUON_CHAIN where ``gluon`` says the Gluon chain can run the call); several sequences on the Triton chain
    keep the fused form (their chain is not the whole call: `triton_chunk`'s module docstring). Elsewhere, and for
    short prompts, the fused form autotuned; but where ``gluon`` says the Gluon chain can run the call, several
    sequences that would take the fused form autotuned run on BATCH_GLUON_CHAIN instead (serial): in the scores form
    where the caller asks for it or where ``heads_per_key`` (HV / H) is at least BATCH_SCORES_MIN_HEADS_PER_KEY, else
    fused. The fixed configs were tuned
    for, and fit shared memory at, K = 128 only, so larger key heads are autotuned (which skips configs that do not
    fit). ``itemsize``: of q, k, v; 4-byte inputs get two stages (three need 243.5 KB of shared memory,
    over the H200's 227 KB per program) and no BV=64 plan (241 KB at two; tests/kernels/test_compile_report)."""
    autotuned = Plan(form=form or Form.FUSED, schedule=Schedule.SERIAL, config=None)
    if K > 128 or chunks < PIPELINE_MIN_CHUNKS:
        return autotuned
    scores = form is Form.SCORES or (form is None and N == 1)
    programs = _cdiv(V, PIPELINE_CONFIG[0]) * N * HV
    if (N == 1 and form is not Form.SPLIT and 2 * programs <= sms
            and chunks >= 2 * SCAN_MIN_SEGMENT_CHUNKS):
        wide = SCAN_MAX_SEGMENTS * programs > sms and itemsize <= 2
        bv, warps, stages = SCAN_WIDE_CONFIG if wide else PIPELINE_CONFIG
        return Plan(form=Form.SCORES if scores else form or Form.FUSED, schedule=Schedule.SCAN,
                    config=(bv, warps, stages if itemsize <= 2 else min(stages, 2)))
    if programs <= sms:
        bv, warps, stages = PIPELINE_CONFIG
        return Plan(form=Form.SCORES if scores else form or Form.FUSED, schedule=Schedule.PIPELINED,
                    config=(bv, warps, stages if itemsize <= 2 else min(stages, 2)))
    if scores and itemsize <= 2 and _cdiv(V, 64) * N * HV <= sms:
        return Plan(form=Form.SCORES, schedule=Schedule.SERIAL, config=ONE_PER_SM_CONFIG,
                    gluon_chain=PROMPT_GLUON_CHAIN if gluon else None)
    if gluon and N > 1 and form is not Form.SPLIT:
        batch_scores = form is Form.SCORES or (form is None and heads_per_key >= BATCH_SCORES_MIN_HEADS_PER_KEY)
        return Plan(form=Form.SCORES if batch_scores else Form.FUSED, schedule=Schedule.SERIAL, config=None,
                    gluon_chain=BATCH_GLUON_CHAIN)
    return autotuned


def scan_segments(programs: int, sms: int, chunks: int) -> int:
    """Segments of a scan call: as many as keep the output chain within one wave of the SMs, with at least
    SCAN_MIN_SEGMENT_CHUNKS chunks each, and at least two."""
    return max(2, min(sms // max(programs, 1), chunks // SCAN_MIN_SEGMENT_CHUNKS, SCAN_MAX_SEGMENTS))
