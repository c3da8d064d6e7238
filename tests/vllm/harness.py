"""Build vLLM 0.33.0's real config, KV cache config and scheduler for a tiny hybrid model on CPU.

Everything here is vLLM's own code path (docs/background/vllm.md section 8): a
``VllmConfig`` from a weightless Qwen3-Next ``config.json``, the platform's
hybrid block-size alignment, per-layer KV cache specs as the model's layers
declare them, vLLM's grouping and tensor planning, vLLM's layout resolution
(which consults our connector's ``get_required_kvcache_layout``), and the real
``Scheduler`` / ``AsyncScheduler``.

The only stand-in is :class:`StandInWorker`: it plays the model runner (there
are no weights to run) and the worker half's *completion reports* (which loads
landed or failed, which reads a consumer finished), driven by the metadata the
connector's scheduler half emits. The data plane itself is tested separately,
between two processes over NIXL (test_worker_nixl.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")

import secrets  # noqa: E402
from collections import deque  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

TINY_MODEL = Path(__file__).resolve().parent / "qwen3_next_tiny"
#: The environment variable holding the tests' shared secret: hex of 32 random bytes (what `hybridkv
#: secret` writes), fresh per test session, set here (and by conftest.py) before any peer process
#: starts, so every process started with the environment proves the same one. Every connector config
#: below reads it through ``secret_env`` unless it names its own secret or lab mode.
SECRET_ENV = "HYBRIDKV_TEST_SECRET"
os.environ.setdefault(SECRET_ENV, secrets.token_hex(32))
_AUTH_KEYS = ("secret_file", "secret_env", "insecure_no_auth")
MAX_MODEL_LEN = 1024
SAMPLED_TOKEN = 11  # what the stand-in model runner samples


def make_vllm_config(
    *,
    role: str = "kv_both",
    async_scheduling: bool = False,
    policy: str = "fail",
    num_blocks: int = 64,
    extra: dict[str, Any] | None = None,
    engine_id: str = "engine-test",
    tp: int = 1,
    model: Path = TINY_MODEL,
    ssm_dtype: str = "auto",
    prefix_caching: bool = True,
    dp_rank: int = 0,
    dp_size: int = 1,
    max_num_seqs: int = 8,
):
    """``ssm_dtype="float32"`` gives the GDN state Qwen3.5 asks for (vLLM turns its
    HF ``mamba_ssm_dtype`` into exactly this cache setting); vLLM's Qwen3.5 model
    class itself cannot be inspected here without torchvision."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    mc = ModelConfig(model=str(model), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN)
    cc = CacheConfig(block_size=16, mamba_cache_mode="none", enable_prefix_caching=prefix_caching,
                     num_gpu_blocks_override=num_blocks, mamba_ssm_cache_dtype=ssm_dtype)
    sc = SchedulerConfig(max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=512, async_scheduling=async_scheduling)
    kvt = KVTransferConfig(kv_connector="HybridKVConnector", kv_connector_module_path="hybridkv.connectors.vllm",
                           kv_role=role, kv_load_failure_policy=policy, engine_id=engine_id,
                           kv_connector_extra_config=with_secret(extra))
    # The configs model a GPU deployment. vLLM's CPU platform, on a host whose CPU has AVX-512 BF16,
    # switches the GDN state to fp32 for its own CPU GDN kernels ("Reset SSM cache type to float32"),
    # which changes every page size and block count below; the hosts that run these tests differ in
    # that flag, so the probe answers "no" while the config is made, as on any GPU host.
    import torch
    from unittest import mock

    with mock.patch.object(torch.cpu, "_is_avx512_bf16_supported", return_value=False):
        vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, kv_transfer_config=kvt,
                        parallel_config=ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp_size,
                                                       data_parallel_rank=dp_rank,
                                                       enable_expert_parallel=dp_size > 1))
    # The CPU platform turns async scheduling off; the scheduler code under test
    # is platform-independent, so put it back (vLLM's own tests pick the class too).
    vc.scheduler_config.async_scheduling = async_scheduling
    # What the engine does once the model's attention backends are known; on a
    # GPU that is FlashAttention (kernel blocks: multiples of 16).
    current_platform._align_hybrid_block_size(vc, FlashAttentionBackend)
    return vc


def with_secret(extra: dict[str, Any] | None) -> dict[str, Any]:
    """``extra`` with the tests' shared secret (``secret_env``), unless it names a secret or lab mode itself;
    with a secret, ``insecure_host_memory`` unless it says otherwise: these workers' caches are CPU tensors,
    which UCX serves over tcp, shm and cma (hybridkv.transport.host_memory), as a CPU deployment would accept."""
    extra = dict(extra or {})
    if not any(k in extra for k in _AUTH_KEYS):
        extra["secret_env"] = SECRET_ENV
    if not extra.get("insecure_no_auth"):
        extra.setdefault("insecure_host_memory", True)
    return extra


def secret_file(directory: str | os.PathLike) -> str:
    """The tests' shared secret in a file of mode 0600 in ``directory``, as `hybridkv secret` writes it."""
    path = os.path.join(directory, "hybridkv-secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.environ[SECRET_ENV] + "\n")
    return path


def layer_specs(vc) -> dict[str, Any]:
    """Per-layer KV cache specs exactly as Qwen3-Next's layers declare them (shared with the bench)."""
    from hybridkv.benchmarks.vllm_model import qwen3_next_layer_specs

    return qwen3_next_layer_specs(vc)


def make_kv_cache_config(vc, *, supported_layouts: list[str] | None = None):
    """vLLM's layout resolution, grouping and tensor planning for the tiny model."""
    from hybridkv.benchmarks.vllm_model import plan_kv_cache

    return plan_kv_cache(vc, layer_specs(vc), supported_layouts=supported_layouts)


def make_scheduler(vc, kv_cache_config, *, async_scheduling: bool, log_stats: bool = False):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.structured_output import StructuredOutputManager

    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vc)
    cls = AsyncScheduler if async_scheduling else Scheduler
    sched = cls(vllm_config=vc, kv_cache_config=kv_cache_config,
                structured_output_manager=StructuredOutputManager(vc),
                block_size=block_size, hash_block_size=hash_block_size, log_stats=log_stats)
    if vc.cache_config.enable_prefix_caching:
        # The engine core gives every request its block hasher before the scheduler sees it.
        hasher, add = block_hasher(sched), sched.add_request

        def add_request(request):
            if request._block_hasher is None:
                request._block_hasher = hasher
                request.update_block_hashes()
            return add(request)

        sched.add_request = add_request
    return sched


def make_request(rid: str, *, prompt_len: int, max_tokens: int, params: dict[str, Any] | None = None,
                 stop_on_first: bool = False, suffix_seed: int | None = None, prefix_len: int = 0):
    """A request; ``stop_on_first`` makes it stop at its first sampled token, which
    the scheduler cannot foresee (as with EOS), unlike a length cap."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=not stop_on_first,
                        stop_token_ids=[SAMPLED_TOKEN] if stop_on_first else None,
                        extra_args={"kv_transfer_params": params} if params is not None else None)
    tokens = [(7 * i + 3) % 1000 for i in range(prompt_len)]
    if suffix_seed is not None:
        # Prompts that share their first ``prefix_len`` tokens and differ after (prefix caching).
        tokens[prefix_len:] = [(13 * i + 5 + 101 * suffix_seed) % 1000 for i in range(prefix_len, prompt_len)]
    # The scheduler make_scheduler builds gives it its block hasher, as vLLM's engine core does.
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp, pooling_params=None)


def block_hasher(sched):
    """The block hasher vLLM's engine core gives every request (prefix caching needs it)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    vc = sched.vllm_config
    fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    init_none_hash(fn)
    return get_request_block_hasher(sched.kv_cache_config.hash_block_size, fn, vc.num_hash_lookahead_tokens)


def remote_prefill_params(rid: str, *, groups: int, blocks_per_group: int = 2) -> dict[str, Any]:
    """What a producer's request_finished returns, as a proxy forwards it to decode."""
    return {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-engine",
        "remote_request_id": f"p-{rid}", "remote_host": "127.0.0.1", "remote_port": 5600,
        "remote_block_ids": [list(range(1, 1 + blocks_per_group))] * groups, "tp_size": 1,
        "remote_capability": token(f"p-{rid}").hex(),
    }


def token(rid: str) -> bytes:
    """A request's capability token, the same in every test process (a deployment issues a random one)."""
    import hashlib

    return hashlib.sha256(b"hybridkv-test-token:" + rid.encode()).digest()[:16]


@dataclass
class LoadFate:
    after_steps: int = 1  # how many executed steps after the order the load completes
    fail: bool = False


@dataclass
class StandInWorker:
    """Plays the model runner and the worker half's completion reports (see module doc)."""

    fates: dict[str, LoadFate] = field(default_factory=dict)
    consumer_reads: bool = True  # prefill side: a consumer reads each offered export one step later
    renewing: set[str] = field(default_factory=set)  # prefill side: exports whose consumer heartbeats
    orders: list[tuple[int, str]] = field(default_factory=list)  # (step, request) of every load order seen
    order_blocks: dict[str, set[int]] = field(default_factory=dict)
    offered: list[tuple[int, str]] = field(default_factory=list)
    bound: dict[str, list[str]] = field(default_factory=dict)  # prefill side: the decode_hosts an offer carried
    _loads: dict[str, int] = field(default_factory=dict)  # request -> steps left
    _reads: dict[str, int] = field(default_factory=dict)

    def execute(self, so) -> Any:
        from vllm.v1.outputs import KVConnectorOutput

        from hybridkv.connectors.vllm.metadata import HybridKVConnectorMetadata, HybridKVWorkerMetadata

        meta = so.kv_connector_metadata
        assert isinstance(meta, HybridKVConnectorMetadata)
        for order in meta.recvs:
            self.orders.append((meta.step, order.request_id))
            self.order_blocks[order.request_id] = {b for ids in order.local_block_ids for b in ids}
            self._loads[order.request_id] = self.fates.get(order.request_id, LoadFate()).after_steps
        for rid in meta.exports_ready:
            self.offered.append((meta.step, rid))
            if rid in meta.decode_hosts:
                self.bound[rid] = meta.decode_hosts[rid]
            if self.consumer_reads:
                self._reads[rid] = 1
        for rid in meta.exports_ended:
            self._reads.pop(rid, None)
        recving, failed, sending = set(), set(), set()
        for rid in list(self._loads):
            self._loads[rid] -= 1
            if self._loads[rid] <= 0:
                del self._loads[rid]
                recving.add(rid)  # failed loads are reported finished too (vLLM's contract)
                if self.fates.get(rid, LoadFate()).fail:
                    failed.add(rid)
        for rid in list(self._reads):
            self._reads[rid] -= 1
            if self._reads[rid] <= 0:
                del self._reads[rid]
                sending.add(rid)
        kv_out = KVConnectorOutput(finished_sending=sending, finished_recving=recving, failed_recving=failed,
                                   kv_connector_worker_meta=HybridKVWorkerMetadata(step=meta.step,
                                                                                   renewed=set(self.renewing)))
        req_ids = list(so.num_scheduled_tokens)
        return req_ids, kv_out

    def pending(self) -> bool:
        return bool(self._loads or self._reads)


class Driver:
    """The engine core's loop: schedule, execute, update; two steps in flight when async."""

    def __init__(self, sched, worker: StandInWorker, *, async_scheduling: bool) -> None:
        self.sched = sched
        self.worker = worker
        self.depth = 2 if async_scheduling else 1
        self.queue: deque = deque()
        self.finished: dict[str, Any] = {}  # request -> (finish reason, kv_transfer_params)
        self.steps = 0
        #: request -> draft tokens scheduled for it, over all steps (speculative decoding)
        self.drafts_scheduled: dict[str, int] = {}
        #: step -> {request: blocks it held when the step was scheduled}
        self.touched: dict[int, dict[str, set[int]]] = {}
        #: steps whose output was processed, and how many schedule() calls had
        #: happened at that moment
        self.completed_at: dict[int, int] = {}
        #: step -> blocks vLLM asked the worker to zero before that step (Race B)
        self.zeroed: dict[int, set[int]] = {}
        #: request -> the step whose schedule() allocated its blocks for a load
        self.load_alloc_step: dict[str, int] = {}
        #: the SchedulerStats update_from_output returned (make_scheduler(log_stats=True))
        self.scheduler_stats: list[Any] = []

    def step(self) -> None:
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import RequestStatus

        so = self.sched.schedule()
        self.steps += 1
        step = so.kv_connector_metadata.step
        mgr = self.sched.kv_cache_manager
        self.touched[step] = {rid: {b for ids in mgr.get_block_ids(rid) for b in ids}
                              for rid in so.num_scheduled_tokens}
        self.zeroed[step] = set(so.new_block_ids_to_zero or ())
        for rid, req in self.sched.requests.items():
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.load_alloc_step.setdefault(rid, step)
        req_ids, kv_out = self.worker.execute(so)
        sampling = {rid for rid in req_ids if not self.sched.requests[rid].is_prefill_chunk}
        # Speculative decoding: every draft is SAMPLED_TOKEN (see _update), so all are accepted, plus a bonus token.
        spec = so.scheduled_spec_decode_tokens
        for rid, tokens in spec.items():
            self.drafts_scheduled[rid] = self.drafts_scheduled.get(rid, 0) + len(tokens)
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=[[SAMPLED_TOKEN] * (1 + len(spec.get(r, ()))) if r in sampling
                                                   else [] for r in req_ids],
                                kv_connector_output=kv_out)
        self.queue.append((so, mro))
        while len(self.queue) >= self.depth:
            self._update()

    def _update(self) -> None:
        so, mro = self.queue.popleft()
        self.completed_at[so.kv_connector_metadata.step] = self.steps
        outs = self.sched.update_from_output(so, mro)
        drafts = self.sched.num_spec_tokens
        if drafts and self.depth == 1:
            # The drafter's proposals for the next step (AsyncScheduler schedules placeholders itself).
            from vllm.v1.outputs import DraftTokenIds

            ids = [r for r in mro.req_ids if r in self.sched.requests and not self.sched.requests[r].is_finished()]
            self.sched.update_draft_token_ids(DraftTokenIds(req_ids=ids, draft_token_ids=[[SAMPLED_TOKEN] * drafts
                                                                                          for _ in ids]))
        for eco in outs.values():
            if eco.scheduler_stats is not None:
                self.scheduler_stats.append(eco.scheduler_stats)
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = (o.finish_reason, o.kv_transfer_params)

    def run_for(self, seconds: float, until) -> None:
        """Step in wall-clock time until ``until()``: real transfers complete off-step."""
        import time

        deadline = time.monotonic() + seconds
        while not until():
            if time.monotonic() > deadline:
                raise AssertionError(f"not done after {seconds} s")
            self.step()
            time.sleep(0.005)

    def drain(self) -> None:
        while self.queue:
            self._update()

    def run(self, max_steps: int = 200, until=None) -> None:
        for _ in range(max_steps):
            if until is not None and until():
                return
            if not self.sched.has_requests() and not self.worker.pending():
                self.drain()
                if not self.sched.has_requests():
                    return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")


def free_blocks(sched) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


class RealWorker:
    """The model runner stand-in around a *real* worker-role HybridKVConnector.

    It calls the connector exactly as vLLM's ``KVConnectorModelRunnerMixin`` does
    each step (bind metadata, start loads, wait_for_save, transfer results,
    worker metadata, clear). The only thing played is the forward pass: with
    ``writes=True`` it fills every block of every scheduled request with random
    bytes, as a prefill would overwrite them.
    """

    def __init__(self, connector, kv_caches, sched, *, writes: bool, seed: int = 0, only_new: bool = False) -> None:
        """``only_new``: a step writes only the attention blocks of the tokens it computes and each
        GDN group's running-state slot, as a model does; blocks of a cached prefix stay as they are
        (prefix caching). Otherwise it writes every block the request holds."""
        import torch

        self.conn = connector
        self.kv_caches = kv_caches
        self.sched = sched
        self.writes = writes
        self.gen = torch.Generator().manual_seed(seed)
        self.orders: list[tuple[int, str]] = []
        self.order_blocks: dict[str, tuple[tuple[int, ...], ...]] = {}
        self.snapshots: dict[str, dict[str, list[bytes]]] = {}  # request -> layer -> page bytes, at arrival
        self.failed: set[str] = set()
        self.only_new = only_new
        self.tables: dict[str, tuple[list[int], ...]] = {}  # request -> its block table when its load landed
        self.table_pages: dict[str, dict[str, list[bytes]]] = {}  # request -> layer -> that table's page bytes

    def execute(self, so):
        from vllm.v1.outputs import KVConnectorOutput

        meta = so.kv_connector_metadata
        for order in meta.recvs:
            self.orders.append((meta.step, order.request_id))
            self.order_blocks[order.request_id] = order.local_block_ids
        self.conn.bind_connector_metadata(meta)
        self.conn.start_load_kv(None)
        if self.writes:
            self._forward(so)
        self.conn.wait_for_save()
        res = self.conn.get_transfer_results(so.finished_req_ids)
        wmeta = self.conn.build_connector_worker_meta()
        self.conn.clear_connector_metadata()
        for rid in res.finished_recving:
            if rid in self.order_blocks and rid not in res.failed_recving:
                self.snapshots[rid] = self.pages(self.order_blocks[rid])
                table = tuple(list(ids) for ids in self.sched.kv_cache_manager.get_block_ids(rid))
                self.tables[rid] = table
                kcc = self.sched.kv_cache_config
                self.table_pages[rid] = self.pages(tuple([b for b in table[g] if b != 0] for g in kcc.transfer_group_ids))
        self.failed |= res.failed_recving
        kv_out = KVConnectorOutput(finished_sending=res.finished_sending, finished_recving=res.finished_recving,
                                   failed_recving=res.failed_recving, kv_connector_worker_meta=wmeta,
                                   kv_connector_stats=self.conn.get_kv_connector_stats())
        return list(so.num_scheduled_tokens), kv_out

    def _forward(self, so) -> None:
        import torch

        mgr = self.sched.kv_cache_manager
        kcc = self.sched.kv_cache_config
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            end = req.num_computed_tokens  # schedule() already advanced it past this step's tokens
            for gid, ids in enumerate(mgr.get_block_ids(rid)):
                if self.only_new:
                    writes = self._new_blocks(gid, ids, end - n, end, req.all_token_ids)
                else:
                    writes = [(b, None) for b in ids]
                for name in kcc.kv_cache_groups[gid].layer_names:
                    t = self.kv_caches[name]
                    for b, tokens in writes:
                        page = t[b]
                        nbytes = page.numel() * page.element_size()
                        gen = self.gen if tokens is None else _content_generator(name, tokens)
                        rnd = torch.randint(-128, 128, (nbytes,), dtype=torch.int8, generator=gen)
                        page.copy_(rnd.view(page.dtype).view(page.shape))

    def _new_blocks(self, gid: int, ids: list[int], start: int, end: int, tokens) -> list[tuple[int, tuple]]:
        """The pages a step computing tokens [start, end) writes, each with the tokens its content
        depends on: as in a model, equal prompts give equal pages (what prefix caching relies on)."""
        from vllm.v1.kv_cache_interface import MambaSpec

        spec = self.sched.kv_cache_config.kv_cache_groups[gid].kv_cache_spec
        if isinstance(spec, MambaSpec):
            live = [b for b in ids[: len(ids) - spec.num_speculative_blocks] if b != 0]
            return [(live[-1], tuple(tokens[:end]))] if live else []  # the running-state slot
        bs = spec.block_size
        first, last = start // bs, -(-end // bs)
        return [(b, tuple(tokens[: min((i + 1) * bs, end)]))
                for i, b in enumerate(ids[first:last], start=first) if b != 0]

    def pages(self, block_ids) -> dict[str, list[bytes]]:
        """Bytes of each layer's page of the given per-transfer-group block lists."""
        kcc = self.sched.kv_cache_config
        out: dict[str, list[bytes]] = {}
        for gid, ids in zip(kcc.transfer_group_ids, block_ids):
            for name in kcc.kv_cache_groups[gid].layer_names:
                t = self.kv_caches[name]
                out[name] = [t[b].contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
                             for b in ids]
        return out

    def pending(self) -> bool:
        return False


def _content_generator(layer: str, tokens: tuple):
    import hashlib

    import torch

    digest = hashlib.blake2b(repr((layer, tokens)).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def make_worker(vc, kcc):
    """A worker-role connector from vLLM's factory, registered with tensors allocated as vLLM does."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.worker.utils import allocate_kv_cache

    kv_caches = allocate_kv_cache(kcc, torch.device("cpu"), vc.cache_config.get_resolved_kv_cache_layout(), None)
    conn = KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.WORKER, kv_cache_config=kcc)
    conn.register_kv_caches(kv_caches)
    return conn, kv_caches


def real_decode(vc, kcc, *, async_scheduling: bool, log_stats: bool = False):
    """A decode engine whose worker half is real (its own NIXL agent; it loads but writes no model output):
    (scheduler, worker connector, runner, driver)."""
    sched = make_scheduler(vc, kcc, async_scheduling=async_scheduling, log_stats=log_stats)
    conn, kv_caches = make_worker(vc, kcc)
    runner = RealWorker(conn, kv_caches, sched, writes=False)
    return sched, conn, runner, Driver(sched, runner, async_scheduling=async_scheduling)


def nixl_connector_state(vc, kcc, kv_caches, ppl: int):
    """The state vLLM 0.33.0's NixlConnector worker derives in ``register_kv_caches`` (see test_scheme_check)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import derive_mamba_conv_split
    from vllm.v1.kv_cache_interface import MambaSpec

    bases: list[int] = []
    ssm_regions: list[int] = []
    group_of_region: list[int] = []
    for gid, group in enumerate(kcc.kv_cache_groups):
        for name in group.layer_names:
            addr = kv_caches[name].data_ptr()
            if addr not in bases:
                bases.append(addr)
                group_of_region.append(gid)
            elif group_of_region[bases.index(addr)] != gid:
                group_of_region[bases.index(addr)] = -1  # shared by several groups
            r = bases.index(addr)
            if isinstance(group.kv_cache_spec, MambaSpec) and r not in ssm_regions:
                ssm_regions.append(r)
    mamba = next(g.kv_cache_spec for g in kcc.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec))
    return SimpleNamespace(
        _has_mamba=True,
        _conv_decomp=derive_mamba_conv_split(mamba, vc.parallel_config.tensor_parallel_size),
        _ssm_region_indices=ssm_regions,
        block_len_per_layer=[0] * len(bases),
        _transfer_layer_group_ids=[],
        num_regions=len(bases),
        region_group_ids=group_of_region,
        _uses_region_group_mapping=len(set(group_of_region)) > 1,
        _group_spec_types=[type(g.kv_cache_spec) for g in kcc.transfer_groups],
        _scratch_region_indices=[],
        _ple_group_index=None,
        kv_cache_config=kcc,
        _physical_blocks_per_logical_kv_block=ppl,
    )


def nixl_connector_descriptor_ids(block_lists, *, kernel_block: int | None = None,
                                  case: tuple[str, dict[str, Any]] | None = None) -> int:
    """How many descriptor ids vLLM 0.33.0's NixlConnector hands NIXL to read these
    per-transfer-group block lists of the tiny model (or of a families.py ``(case, options)``),
    in the LBHNC layout it forces."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
    from vllm.v1.worker.utils import allocate_kv_cache

    if case is None:
        vc = make_vllm_config(role="kv_consumer")
        vc.cache_config.kv_cache_layout = "LBHNC"
        kcc = make_kv_cache_config(vc)
    else:
        from tests.vllm import families as fam

        vc, kcc = fam.config(case[0], role="kv_consumer", layout="LBHNC", **case[1])
    ppl = 1 if kernel_block is None else vc.cache_config.block_size // kernel_block
    kv = allocate_kv_cache(kcc, torch.device("cpu"), vc.cache_config.get_resolved_kv_cache_layout(), None)
    state = nixl_connector_state(vc, kcc, kv, ppl)
    physical = NixlBaseConnectorWorker._logical_to_kernel_block_ids(state, tuple(list(b) for b in block_lists), ppl)
    ids = NixlBaseConnectorWorker._compute_desc_ids(state, physical, dst_num_blocks=kcc.num_blocks * ppl,
                                                    block_size_ratio=None, physical_blocks_per_logical=ppl)
    return len(ids)
