"""Buffer keys that name what a buffer holds, not where it sits in SGLang's pointer lists.

Both sides key their buffers alike and pairing matches them key by key, so a
buffer that only one side has must not shift the keys of the others. SGLang's
lists have three such optional parts, and its NIXL backend tolerates each:

* speculative draft KV (MTP/EAGLE), the last `num_draft_entries` of the KV lists,
  on the decode only (or on both);
* metadata (aux) buffers enabled on one engine only: the sampling mask
  (`SGLANG_ENABLE_DISAGG_SAMPLING_MASK`, three buffers in the middle of the list),
  the DSA top-k buffer and `--disaggregation-enable-kv-checksum` (the last one).
  SGLang pairs aux buffers by position and sends the shorter list, misaligned
  when the extra buffer is not the last (`check_peer_aux_buffer_count`); here
  they are keyed by role, so every buffer both sides have lands in its own row.

Sections (keys are int64 on the wire): target KV entry i -> i; draft entry j ->
DRAFT + j; entry i of state type c -> STATE * (c + 1) + i; aux role r -> AUX + its
index in AUX_ROLES; an aux list the catalogue does not explain -> AUX_POSITIONAL + i
(SGLang's positional rule, a common prefix pairs).
"""

from __future__ import annotations

_SECTION = 1 << 20
DRAFT = _SECTION
STATE = 2 * _SECTION  # state type c: STATE * (c + 1) + i, c < 64
AUX = 1 << 28
AUX_POSITIONAL = AUX + (1 << 16)

#: SGLang 0.5.23 MetadataBuffers.get_buf_infos, in its order
AUX_ROLES = (
    "output_ids", "cached_tokens", "output_token_logprobs_val", "output_token_logprobs_idx",
    "output_top_logprobs_val", "output_top_logprobs_idx",
    "sampling_mask_len", "sampling_mask_idx", "sampling_logprobs",
    "output_topk_p", "output_topk_index", "output_hidden_states", "dsa_topk_indices",
    "bootstrap_room", "kv_checksum",
)
_SAMPLING_MASK = ("sampling_mask_len", "sampling_mask_idx", "sampling_logprobs")
#: aux roles an engine enables on its own; the rest are always there
OPTIONAL_AUX = frozenset(_SAMPLING_MASK + ("dsa_topk_indices", "kv_checksum"))
#: the row SGLang's decode checks before it takes a transfer as done: both sides must have it
REQUIRED_AUX = "bootstrap_room"


def aux_roles(count: int, *, sampling_mask: bool, kv_checksum: bool) -> tuple[str, ...] | None:
    """The role of each of `count` aux buffers from the engine's switches (the DSA top-k buffer is the
    one left to infer: present iff one buffer more than the switches explain); None where the catalogue
    does not explain the count (another SGLang version): those buffers are keyed by position."""
    base = [r for r in AUX_ROLES if r not in OPTIONAL_AUX]
    extra = (len(_SAMPLING_MASK) if sampling_mask else 0) + (1 if kv_checksum else 0)
    dsa = count - len(base) - extra
    if dsa not in (0, 1):
        return None
    on = set(base) | (set(_SAMPLING_MASK) if sampling_mask else set()) | ({"kv_checksum"} if kv_checksum else set())
    if dsa:
        on.add("dsa_topk_indices")
    return tuple(r for r in AUX_ROLES if r in on)


def kv_key(i: int, *, num_entries: int, num_draft: int) -> int:
    """Key of entry i of SGLang's KV lists (the last `num_draft` are draft KV)."""
    target = num_entries - num_draft
    return i if i < target else DRAFT + (i - target)


def state_key(state_type: int, i: int) -> int:
    return STATE * (state_type + 1) + i


def aux_key(i: int, roles: tuple[str, ...] | None) -> int:
    return AUX + AUX_ROLES.index(roles[i]) if roles is not None else AUX_POSITIONAL + i


def is_draft(key: int) -> bool:
    return DRAFT <= key < STATE


def is_aux(key: int) -> bool:
    return key >= AUX


def aux_role(key: int) -> str | None:
    """The role an aux key names (None: a positional key)."""
    return AUX_ROLES[key - AUX] if AUX <= key < AUX + len(AUX_ROLES) else None


def describe(key: int) -> str:
    """A buffer key in words, for messages."""
    if is_aux(key):
        role = aux_role(key)
        return f"aux buffer {role!r}" if role else f"aux buffer {key - AUX_POSITIONAL}"
    if is_draft(key):
        return f"draft KV buffer {key - DRAFT}"
    if key >= STATE:
        return f"state type {key // STATE - 1} buffer {key % STATE}"
    return f"KV buffer {key}"


def tolerated_one_sided(key: int) -> bool:
    """A buffer one side may have without the other (SGLang's NIXL backend tolerates it): draft KV, an
    optional aux role, or an aux buffer past the other side's positional list."""
    if is_draft(key):
        return True
    if key >= AUX_POSITIONAL:
        return True
    role = aux_role(key)
    return role is not None and role in OPTIONAL_AUX
