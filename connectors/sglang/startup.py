"""What the hybridkv SGLang backend refuses, or settles, before a manager starts.

Each check runs on the values SGLang itself acts on (its runtime context, its
``envs``, the ``KVArgs`` it built), before anything is registered or bound, and
raises ValueError with a message naming the setting and what to do about it: a
configuration hybridkv cannot keep correct stops the server at start-up instead
of failing requests later.

* Pipeline and attention context parallelism: the backend pairs buffers by their
  position in SGLang's pointer lists, which a PP stage or a CP rank cuts
  differently (SGLang's NIXL backend pairs PP stages by layer id); refused.
* State types: every type SGLang 0.5.23's NIXL backend moves, except DSA_TAIL,
  whose "indices" are a ring-segment tuple rather than slot ids; refused, naming
  it. Which TP pairs each type moves at is decided per peer
  (connectors/sglang/adopt.py, pairing.py).
* The drain timeout against SGLang's deferred decode KV release: SGLang frees a
  held request's pages once ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``
  passed, whatever the backend answers, so hybridkv must stop waiting no later
  (`drain_timeout`).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from hybridkv.connectors.sglang import buffer_keys
from hybridkv.connectors.sglang.config import SGLangConfig

logger = logging.getLogger(__name__)

#: The StateType values hybridkv moves (SGLang's enum values, as `KVArgs.state_types` holds them).
MOVED_STATE_TYPES = frozenset({
    "mamba", "swa", "dsa", "qsa_pending", "qsa_compressed", "swa_ring", "c128_state", "request_row",
    "block_scale", "block_scale_swa", "minimax_index_k", "minimax_dense_kv",
})
#: Why a type SGLang knows is not moved.
REFUSED_STATE_TYPES = {
    "dsa_tail": "its indices are a (slot, offset, count, offset, count, ring size) tuple of a per-request ring, "
                "not slot ids, and rings of different sizes are remapped token by token",
}

DEFERRED_RELEASE_VAR = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
DEFERRED_TIMEOUT_VAR = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
DRAIN_VAR = "HYBRIDKV_SGLANG_DRAIN_TIMEOUT_S"


def state_type_name(st: Any) -> str:
    """SGLang's value of a StateType member ("mamba"), or the string itself."""
    return str(getattr(st, "value", st))


def check_parallel(*, pp_size: int, attn_cp_size: int, role: str) -> None:
    if pp_size > 1:
        raise ValueError(
            f"hybridkv SGLang backend: pipeline parallelism is not supported ({role} --pp-size {pp_size}): its "
            "buffers are paired by their position in SGLang's pointer lists, which each PP stage cuts to its own "
            "layers; expected --pp-size 1 on prefill and decode (or --disaggregation-transfer-backend nixl)")
    if attn_cp_size > 1:
        raise ValueError(
            f"hybridkv SGLang backend: attention context parallelism is not supported ({role} attention CP size "
            f"{attn_cp_size}); expected 1")


def check_state_types(state_types: Iterable[Any]) -> None:
    for st in state_types or ():
        name = state_type_name(st)
        if name in MOVED_STATE_TYPES:
            continue
        why = REFUSED_STATE_TYPES.get(name, "hybridkv does not know what its items hold")
        raise ValueError(
            f"hybridkv SGLang backend: state type {name!r} is not supported: {why}; expected one of "
            f"{sorted(MOVED_STATE_TYPES)} (or --disaggregation-transfer-backend nixl for this model)")


def drain_timeout(config: SGLangConfig, *, decode: bool, waiting_timeout: float | None,
                  deferred_release: bool, deferred_timeout: float, attn_tp_size: int) -> float:
    """The drain timeout of a manager, consistent with SGLang's deferred decode KV release.

    Decode with deferred release on: SGLang releases a held request once its own
    timeout passed, so the drain timeout is that timeout when unset, and a longer
    one is refused. Decode attention TP > 1 with deferred release off: one rank's
    Failed frees every rank's pages while another rank's write may land; refused.
    Otherwise (prefill, or decode TP 1 without deferred release): SGLang's
    waiting timeout, as before."""
    if not decode:
        return config.drain_timeout(None)
    if not deferred_release:
        if attn_tp_size > 1:
            raise ValueError(
                f"hybridkv SGLang backend: {DEFERRED_RELEASE_VAR} is off at decode attention TP {attn_tp_size}: a "
                "request that fails on one rank would free its pages on every rank while a write into another "
                f"rank's pages may still land; expected {DEFERRED_RELEASE_VAR}=1 (the default)")
        return config.drain_timeout(waiting_timeout)
    if config.drain_timeout_s is None:
        d = float(deferred_timeout)
        logger.info("hybridkv: drain timeout %.0f s, SGLang's deferred decode KV release timeout (%s)", d,
                    DEFERRED_TIMEOUT_VAR)
        return d
    if config.drain_timeout_s > deferred_timeout:
        raise ValueError(
            f"hybridkv SGLang backend: {DRAIN_VAR}={config.drain_timeout_s:g} is longer than {DEFERRED_TIMEOUT_VAR}="
            f"{deferred_timeout:g}: SGLang would free a held request's pages while hybridkv still waits for a write "
            f"into them to end; expected {DRAIN_VAR} <= {deferred_timeout:g} (or unset: it follows SGLang's), or a "
            f"longer {DEFERRED_TIMEOUT_VAR}")
    return config.drain_timeout_s


def aux_roles(kv_args: Any, server_args: Any, *, sampling_mask: bool) -> tuple[str, ...] | None:
    """The role of each aux (metadata) buffer, from the switches SGLang's MetadataBuffers reads
    (``SGLANG_ENABLE_DISAGG_SAMPLING_MASK``, ``--disaggregation-enable-kv-checksum``: buffer_keys.py); None,
    with a warning, where SGLang 0.5.23's MetadataBuffers does not explain them (paired by position then)."""
    n = len(getattr(kv_args, "aux_data_ptrs", None) or ())
    roles = buffer_keys.aux_roles(n, sampling_mask=bool(sampling_mask),
                                  kv_checksum=bool(getattr(server_args, "disaggregation_enable_kv_checksum", False)))
    if roles is None and n:
        logger.warning("hybridkv: %d aux (metadata) buffers, which SGLang 0.5.23's MetadataBuffers does not explain; "
                       "they pair by position, as SGLang's NIXL backend pairs them", n)
    return roles
