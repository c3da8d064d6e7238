"""`hybridkv bench vllm-steps`: the vLLM connector's per-step bookkeeping against vLLM's own schedule().

Workload: vLLM 0.33's real ``Scheduler`` on CPU with HybridKVConnector (``kv_both``, prefix caching on
as vLLM's default, so GDN runs in ``mamba_cache_mode='align'``) and a weightless Qwen3-Next-shaped
hybrid (3 GDN layers to 1 full-attention layer, as Qwen3.5). The model's head sizes are chosen so
that vLLM's own hybrid block-size alignment gives the block size asked for: 16 tokens (vLLM's
default block) or 1,056 tokens (a Qwen3.5-sized hybrid block). ``--requests`` requests, each a
``--prompt``-token prompt, are prefilled untimed, then every measured step decodes one token for all
of them (the model runner is played: one sampled token per request, the step's watermark back).

Timed per step, in the same run: ``schedule()`` less the connector's ``build_connector_meta`` inside
it (vLLM's own scheduling), ``build_connector_meta``, and ``update_connector_output`` (inside
``update_from_output``). The figure is the median over the measured steps; the ratio is the
connector's two calls against vLLM's schedule(). Goal: under 5%.
Baseline, same steps: what the scheduler half did before it fenced only what a step writes, i.e.
every block of every scheduled request (``get_block_ids`` walked per step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GOAL = 0.05
MAX_REQUESTS = 20_000
MAX_STEPS = 10_000
MAX_PROMPT = 8_192

#: Head sizes per hybrid block size: vLLM pads the GDN state page to the attention page and picks
#: the smallest block (a multiple of FlashAttention's 16) whose attention page holds the state.
SHAPES: dict[int, dict[str, int]] = {
    # attention 4 x 128 x 2 x 2 B = 2 KiB a token, the GDN state 9.5 KiB: 16 tokens hold it.
    16: {"num_key_value_heads": 4, "head_dim": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
         "linear_key_head_dim": 32, "linear_value_head_dim": 32},
    # attention 1 x 64 x 2 x 2 B = 256 B a token, the GDN state 263.5 KiB: 1,054 tokens, 1,056 aligned.
    1056: {"num_key_value_heads": 1, "head_dim": 64, "linear_num_key_heads": 1, "linear_num_value_heads": 16,
           "linear_key_head_dim": 128, "linear_value_head_dim": 64},
}
BASE_MODEL = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 1024,
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4,
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "decoder_sparse_step": 1,
    "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "num_experts_per_tok": 2,
    "num_experts": 4, "norm_topk_prob": True, "max_position_embeddings": 16384, "rms_norm_eps": 1e-6,
    "rope_theta": 10000000, "partial_rotary_factor": 0.25, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "eos_token_id": 1023,
}


@dataclass(frozen=True, kw_only=True)
class StepCosts:
    """Medians over the measured steps, microseconds."""

    block_tokens: int
    requests: int
    steps: int
    schedule_us: float  # vLLM's schedule() without the connector's build_connector_meta
    build_meta_us: float
    update_output_us: float
    every_block_us: float  # the baseline: every block of every scheduled request, walked

    @property
    def connector_us(self) -> float:
        return self.build_meta_us + self.update_output_us

    @property
    def ratio(self) -> float:
        return self.connector_us / self.schedule_us

    def as_json(self) -> dict[str, Any]:
        return {"block_tokens": self.block_tokens, "requests": self.requests, "steps": self.steps,
                "schedule_us": round(self.schedule_us, 1), "build_connector_meta_us": round(self.build_meta_us, 1),
                "update_connector_output_us": round(self.update_output_us, 1),
                "connector_vs_schedule": round(self.ratio, 4), "every_block_us": round(self.every_block_us, 1)}


def _vllm() -> None:
    import os

    # Without a GPU vLLM must be told its platform before it is first imported.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # The GDN conv state layout hybridkv moves (docs/deploy-vllm.md); read by vLLM at import.
    os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        from hybridkv.errors import MissingExtra

        raise MissingExtra("vLLM", "vllm") from exc


def _engine(model_dir: Path, *, block_tokens: int, requests: int, prompt: int) -> tuple[Any, Any]:
    """A real vLLM Scheduler with HybridKVConnector over a weightless model (as the engine core builds
    it: config, hybrid alignment, per-layer specs, grouping, block hasher)."""
    from unittest import mock

    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.platforms import current_platform
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from hybridkv.benchmarks.vllm_model import plan_kv_cache, qwen3_next_layer_specs

    max_len = prompt + MAX_STEPS + 64
    blocks = requests * (-(-(prompt + 64) // block_tokens) + 12) + 64
    mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=max_len)
    cc = CacheConfig(block_size=16, mamba_cache_mode="none", enable_prefix_caching=True, num_gpu_blocks_override=blocks)
    sc = SchedulerConfig(max_model_len=max_len, is_encoder_decoder=False, max_num_seqs=requests,
                         # the whole untimed prefill in one step
                         max_num_batched_tokens=requests * prompt, async_scheduling=False)
    # Only the scheduler half runs (no worker, nothing listens): lab mode by name, so no secret is needed.
    kvt = KVTransferConfig(kv_connector="HybridKVConnector", kv_connector_module_path="hybridkv.connectors.vllm",
                           kv_role="kv_both", engine_id="bench", kv_connector_extra_config={"insecure_no_auth": True})
    # vLLM's CPU platform turns the GDN state to fp32 on hosts with AVX-512 BF16 (its CPU kernels);
    # the block sizes here model a GPU deployment, so the probe answers as a GPU host would.
    with mock.patch.object(torch.cpu, "_is_avx512_bf16_supported", return_value=False):
        vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, kv_transfer_config=kvt,
                        parallel_config=ParallelConfig())
    current_platform._align_hybrid_block_size(vc, FlashAttentionBackend)
    if vc.cache_config.block_size != block_tokens:
        raise RuntimeError(f"vLLM aligned the hybrid block to {vc.cache_config.block_size} tokens; the bench's "
                           f"model was shaped for {block_tokens}")
    kcc = plan_kv_cache(vc, qwen3_next_layer_specs(vc), available_memory=1 << 50)
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kcc, vc)
    sched = Scheduler(vllm_config=vc, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(vc),
                      block_size=block_size, hash_block_size=hash_block_size, log_stats=False)
    fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    init_none_hash(fn)
    hasher = get_request_block_hasher(hash_block_size, fn, vc.num_hash_lookahead_tokens)
    return sched, hasher


def _timed(obj: Any, name: str, samples: list[int]) -> None:
    """Wrap obj.name so each call's duration (ns) is appended to samples."""
    inner: Callable[..., Any] = getattr(obj, name)
    pc = time.perf_counter_ns

    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = pc()
        try:
            return inner(*args, **kwargs)
        finally:
            samples.append(pc() - t0)

    setattr(obj, name, call)


def measure(*, block_tokens: int, requests: int, prompt: int, steps: int, warmup: int = 3) -> StepCosts:
    if steps + warmup + 16 > MAX_STEPS + 64:
        raise ValueError(f"steps = {steps}; expected at most {MAX_STEPS + 48 - warmup}")
    _vllm()
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

    from hybridkv.connectors.vllm.metadata import HybridKVWorkerMetadata

    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps({**BASE_MODEL, **SHAPES[block_tokens]}))
        sched, hasher = _engine(Path(tmp), block_tokens=block_tokens, requests=requests, prompt=prompt)
    conn = sched.connector
    build: list[int] = []
    update: list[int] = []
    _timed(conn, "build_connector_meta", build)
    _timed(conn, "update_connector_output", update)
    sp = SamplingParams(max_tokens=warmup + steps + 16, ignore_eos=True)
    for i in range(requests):
        # Distinct prompts (no shared prefix): every block is a request's own.
        tokens = [(7 * j + 3 + 131 * i) % 1000 for j in range(prompt)]
        r = Request(request_id=f"r{i}", prompt_token_ids=tokens, sampling_params=sp, pooling_params=None,
                    block_hasher=hasher)
        sched.add_request(r)

    def step() -> tuple[int, int, int]:
        t0 = time.perf_counter_ns()
        so = sched.schedule()
        t1 = time.perf_counter_ns()
        ids = list(so.num_scheduled_tokens)
        t_walk = time.perf_counter_ns()
        mgr = sched.kv_cache_manager
        walked: set[int] = set()
        for rid in ids:
            for group in mgr.get_block_ids(rid):
                walked.update(group)
        t_walk = time.perf_counter_ns() - t_walk
        sampling = [rid for rid in ids if not sched.requests[rid].is_prefill_chunk]
        done = set(sampling)
        kv = KVConnectorOutput(kv_connector_worker_meta=HybridKVWorkerMetadata(step=so.kv_connector_metadata.step))
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[11] if r in done else [] for r in ids], kv_connector_output=kv)
        sched.update_from_output(so, mro)
        return t1 - t0, t_walk, len(sampling)

    # Prefill everyone, untimed.
    for _ in range(8):
        _, _, sampled = step()
        if sampled == requests:
            break
    if sampled != requests:
        raise RuntimeError(f"{len(sched.running)} of {requests} requests running after the prefill; "
                           "the KV pool is too small")
    sched_ns: list[int] = []
    walk_ns: list[int] = []
    build_keep: list[int] = []
    update_keep: list[int] = []
    for i in range(warmup + steps):
        build.clear()
        update.clear()
        total, walk, _ = step()
        if i >= warmup:
            sched_ns.append(total - sum(build))
            walk_ns.append(walk)
            build_keep.append(sum(build))
            update_keep.append(sum(update))
    return StepCosts(block_tokens=block_tokens, requests=requests, steps=steps,
                     schedule_us=statistics.median(sched_ns) / 1e3, build_meta_us=statistics.median(build_keep) / 1e3,
                     update_output_us=statistics.median(update_keep) / 1e3,
                     every_block_us=statistics.median(walk_ns) / 1e3)


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = ("The vLLM connector's per-step bookkeeping (build_connector_meta + "
                          "update_connector_output) against vLLM's own schedule(), in one run.")
    from hybridkv.cli import bounded

    parser.add_argument("--requests", type=bounded(int, MAX_REQUESTS), nargs="+", default=[1000, 5000],
                        help="running (decoding) requests, one case each")
    parser.add_argument("--block-tokens", type=int, nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES),
                        help="hybrid block size in tokens, one case each")
    parser.add_argument("--prompt", type=bounded(int, MAX_PROMPT), default=512, help="prompt tokens of each request")
    parser.add_argument("--steps", type=bounded(int, MAX_STEPS), default=20, help="measured decode steps per case")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hybridkv.cli import print_json

    for name in ("requests", "prompt", "steps"):
        values = getattr(args, name)
        if any(v < 1 for v in (values if isinstance(values, list) else [values])):
            raise ValueError(f"--{name} {values}; expected positive values")
    cases = [measure(block_tokens=b, requests=n, prompt=args.prompt, steps=args.steps)
             for b in args.block_tokens for n in args.requests]
    if args.json:
        print_json({"goal": GOAL, "prompt": args.prompt, "cases": [c.as_json() for c in cases]}, indent=2)
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"vLLM connector bookkeeping per decode step vs vLLM schedule() "
                        f"(median of {args.steps} steps, {args.prompt}-token prompts, same run)")
    for col in ("block tokens", "running", "schedule() ms", "build_connector_meta us", "update_connector_output us",
                "connector / schedule()", "every held block us (before)"):
        table.add_column(col, justify="right")
    for c in cases:
        table.add_row(str(c.block_tokens), str(c.requests), f"{c.schedule_us / 1e3:.2f}", f"{c.build_meta_us:.0f}",
                      f"{c.update_output_us:.0f}", f"{100 * c.ratio:.1f}%", f"{c.every_block_us:.0f}")
    console = Console()
    console.print(table)
    worst = max(c.ratio for c in cases)
    console.print(f"worst case {100 * worst:.1f}% of schedule(): {'meets' if worst < GOAL else 'misses'} "
                  f"the {100 * GOAL:.0f}% goal")
    return 0
