"""Pairing one prefill rank with one decode rank: field keys, who writes what, planners.

Equal or different attention TP, one rule: every byte range of an SGLang
buffer item becomes a `hybridkv.layout.fields.Field` keyed by what it holds, and
`descriptors.TransferPlanner` matches the two sides key by key (merging
pieces that are back to back on both sides, so equal TP still moves whole
items). Keys, per buffer (the layer slot of a key is the buffer's key, which
names what it holds: buffer_keys.py; a buffer one side has and the other has
not, draft KV or an optional aux buffer, is tolerated and not moved):

* a KV page (NHD, `[page_size][local heads][head bytes]`): when both sides hold
  the same number of heads per rank, the whole item, keyed by its first head;
  otherwise one field per (token, run of `u` heads), `u` the smaller per-rank
  head count, keyed `token * total_heads + first head` (FieldKind.KV);
* a Mamba state item: the whole item (keyed by rank) when both sides shard
  states alike; otherwise, per outer row and sub-block, one field per unit of
  `full / lcm(tp_p, tp_d)` dims, keyed by the unit's global dim
  (GDN conv sub-blocks: CONV_Q / CONV_K / CONV_V; other tensors: SSM);
* aux rows and replicated items: the whole item, the same key on every rank.

The units only depend on the two TP sizes, so both sides cut alike. Which
prefill ranks a decode rank reads is SGLang's own mapping
(`CommonKVManager._resolve_rank_mapping`); a field held by several of them
(GQA replicas when TP exceeds the KV heads, replicated state, aux rows) is
written by the first one only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

from hybridkv.connectors.sglang import buffer_keys as keys_of
from hybridkv.connectors.sglang.adopt import AdoptedLayout
from hybridkv.connectors.sglang.shapes import BufferShape, Parallel, Slicing
from hybridkv.descriptors.compiler import TransferPlanner
from hybridkv.descriptors.planning import source_ranks
from hybridkv.transport.settings import is_int
from hybridkv.layout.fields import FieldKind
from hybridkv.layout.fields import Field, FieldKey
from hybridkv.layout.kinds.attention import heads_of_rank
from hybridkv.ids import GroupId
from hybridkv.layout import GroupLayout, Layout, Placement
from hybridkv.fencing.request_state import Component

_CONV_SUB = (FieldKind.CONV_Q, FieldKind.CONV_K, FieldKind.CONV_V)


def prefill_sources(prefill_tp: int, decode_tp: int, decode_rank: int) -> tuple[tuple[int, ...], int]:
    """The prefill ranks decode rank `decode_rank` reads, and how many decode ranks read
    each of them (SGLang: `target_tp_ranks`, `required_dst_info_num`): the core's mapping
    (NixlConnector's and SGLang's are the same), named as SGLang's pairs name it."""
    if is_int(prefill_tp) and is_int(decode_tp) and min(prefill_tp, decode_tp) > 0 \
            and max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
        raise ValueError(f"prefill attention TP {prefill_tp} and decode attention TP {decode_tp}: "
                         "expected one to divide the other")
    return source_ranks(decode_tp, decode_rank, prefill_tp)


# --------------------------------------------------------------------------- compatibility


def check_pair(prefill: AdoptedLayout, decode: AdoptedLayout) -> tuple[str, ...]:
    """ValueError, naming the values, unless a prefill and a decode rank can pair; else what one side
    has that the other has not and is tolerated (draft KV, optional aux buffers: buffer_keys.py), in words."""
    p, d = prefill.parallel, decode.parallel
    mine = {b.key: (b.group_id, prefill.shapes[b.key].slicing.value) for b in prefill.buffers}
    theirs = {b.key: (b.group_id, decode.shapes[b.key].slicing.value) for b in decode.buffers}
    if p.draft_entries and d.draft_entries and p.draft_entries != d.draft_entries:
        raise ValueError(f"{p.draft_entries} speculative draft KV buffers on the prefill, {d.draft_entries} "
                         "on the decode; expected the same draft model on both (or on one side only)")
    one_sided = set(mine) ^ set(theirs)
    diff = sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])
    diff += sorted(k for k in one_sided if not keys_of.tolerated_one_sided(k))
    if diff:
        raise ValueError(f"{keys_of.describe(diff[0])} is (group, slicing) {mine.get(diff[0])} on the prefill and "
                         f"{theirs.get(diff[0])} on the decode ({len(diff)} buffers differ); expected the same model")
    if {c for c, _ in prefill.components} != {c for c, _ in decode.components}:
        raise ValueError("the peers split their buffers into different components; expected the same model")
    if p.page_size != d.page_size:
        raise ValueError(f"page size {p.page_size} on the prefill, {d.page_size} on the decode; expected equal")
    notes = tuple(f"{keys_of.describe(k)} only on the {'prefill' if k in mine else 'decode'}: not transferred"
                  for k in sorted(one_sided))
    if p.attn_tp == d.attn_tp and p.state_tp == d.state_tp:
        for b in prefill.buffers:
            if b.key in one_sided:
                continue
            other = decode.buffer(b.key)
            if other.item_bytes != b.item_bytes:
                raise ValueError(f"{keys_of.describe(b.key)}: item of {b.item_bytes} bytes on the prefill, "
                                 f"{other.item_bytes} on the decode at equal TP {p.attn_tp}; expected the same model")
        return notes
    _check_hetero(prefill, decode, one_sided)
    return notes


def _check_hetero(prefill: AdoptedLayout, decode: AdoptedLayout, one_sided: set[int]) -> None:
    p, d = prefill.parallel, decode.parallel
    what = f"prefill attention TP {p.attn_tp} -> decode TP {d.attn_tp}"
    prefill_sources(p.attn_tp, d.attn_tp, d.attn_rank)  # divisibility
    for side, par in (("prefill", p), ("decode", d)):
        if par.state_tp != par.attn_tp:
            raise ValueError(f"{what}: the {side} shards linear-attention state over {par.state_tp} ranks and "
                             f"attention over {par.attn_tp}; expected the same group")
        if par.kv_layout not in (None, "nhd", "NHD"):
            raise ValueError(f"{what}: the {side} KV layout is {par.kv_layout!r}; head slices need NHD pages")
    # Draft KV buffers (MTP/EAGLE, appended to SGLang's KV lists) are NHD pages of the same heads: sliced like KV,
    # as SGLang's NIXL backend slices every entry of its KV lists (the per-buffer head-size checks below hold them).
    if p.mla != d.mla:
        raise ValueError(f"{what}: MLA on the prefill is {p.mla}, on the decode {d.mla}; expected the same model")
    if p.kv_heads != d.kv_heads:
        raise ValueError(f"{what}: {p.kv_heads} KV heads in total on the prefill, {d.kv_heads} on the decode; "
                         "expected the same model")
    for par in (p, d):
        if par.kv_heads % par.attn_tp and par.attn_tp % par.kv_heads:
            raise ValueError(f"{what}: {par.kv_heads} KV heads do not shard over attention TP {par.attn_tp}")
    for b in prefill.buffers:
        if b.key in one_sided:
            continue
        sp, sd, other = prefill.shapes[b.key], decode.shapes[b.key], decode.buffer(b.key)
        if sp.slicing is Slicing.RANK:
            kind = (f"state type {prefill.state_type_of(b.group_id)!r}" if 0 < b.group_id <= prefill.num_state_groups
                    else "a buffer")
            raise ValueError(f"{what}: {kind} (group {b.group_id}, buffer {b.key}) is moved at equal attention TP "
                             "only (SGLang gives no slicing for it on this model); expected prefill and decode "
                             "attention TP equal")
        if sp.slicing is Slicing.WHOLE:
            if b.item_bytes != other.item_bytes:
                raise ValueError(f"{what}: buffer {b.key} is the same on every rank but its item has "
                                 f"{b.item_bytes} bytes on the prefill, {other.item_bytes} on the decode")
        elif sp.slicing is Slicing.HEADS:
            hp, hd = (len(heads_of_rank(x.kv_heads, x.attn_tp, 0)) for x in (p, d))
            for side, heads, item in (("prefill", hp, b.item_bytes), ("decode", hd, other.item_bytes)):
                if item % (p.page_size * heads):
                    raise ValueError(f"{what}: buffer {b.key} item of {item} bytes on the {side} does not split "
                                     f"into {p.page_size} tokens x {heads} heads")
            bp, bd = b.item_bytes // (p.page_size * hp), other.item_bytes // (p.page_size * hd)
            if bp != bd:
                raise ValueError(f"{what}: buffer {b.key} holds {hp} heads of {bp} bytes per token on the prefill, "
                                 f"{hd} heads of {bd} bytes on the decode; expected equal head sizes")
        else:
            _check_dims(what, b.key, sp, sd, b.item_bytes, other.item_bytes, p.state_tp, d.state_tp)


def _check_dims(what: str, key: int, sp: BufferShape, sd: BufferShape, item_p: int, item_d: int,
                tp_p: int, tp_d: int) -> None:
    full_p, full_d = sp.dim * tp_p, sd.dim * tp_d
    if full_p != full_d or sp.outer != sd.outer or sp.sub != sd.sub:
        raise ValueError(f"{what}: state buffer {key} is {sp.dim} of {full_p} dims x {sp.outer} rows "
                         f"(sub-blocks {list(sp.sub)}) on the prefill, {sd.dim} of {full_d} x {sd.outer} "
                         f"(sub-blocks {list(sd.sub)}) on the decode; expected the same state")
    if item_p % (sp.dim * sp.outer) or item_d % (sd.dim * sd.outer) \
            or item_p // (sp.dim * sp.outer) != item_d // (sd.dim * sd.outer):
        raise ValueError(f"{what}: state buffer {key} has items of {item_p} and {item_d} bytes for {sp.dim} and "
                         f"{sd.dim} dims; expected the same bytes per dim")
    blocks = sp.sub or (full_p,)
    if sum(blocks) != full_p:
        raise ValueError(f"{what}: state buffer {key}'s sub-blocks {list(blocks)} sum to {sum(blocks)}, not its "
                         f"{full_p} dims (SGLang pads GDN groups when TP does not divide the key heads)")
    lcm = math.lcm(tp_p, tp_d)
    bad = [f for f in blocks if f % lcm]
    if bad:
        raise ValueError(f"{what}: state buffer {key}'s sub-block of {bad[0]} dims does not split over TP "
                         f"{tp_p} and {tp_d}")


# --------------------------------------------------------------------------- fields


def buffer_fields(side: AdoptedLayout, key: int, *, rank: int, peer: Parallel) -> Iterator[Field]:
    """The fields of one item of buffer `key` on attention-TP rank `rank` of `side`, against
    a peer sharded as `peer` (offsets inside the item; `rank` may be another rank of the same side)."""
    par, shape, item = side.parallel, side.shapes[key], side.buffer(key).item_bytes
    if shape.slicing is Slicing.WHOLE:
        yield Field(key=(FieldKind.OPAQUE, key, 0), offset=0, nbytes=item)
    elif shape.slicing is Slicing.RANK:
        yield Field(key=(FieldKind.OPAQUE, key, rank), offset=0, nbytes=item)
    elif shape.slicing is Slicing.HEADS:
        heads = heads_of_rank(par.kv_heads, par.attn_tp, rank)
        peer_heads = len(heads_of_rank(par.kv_heads, peer.attn_tp, 0))
        if peer_heads == len(heads):
            yield Field(key=(FieldKind.OPAQUE, key, heads.start), offset=0, nbytes=item)
            return
        unit = min(peer_heads, len(heads))
        hb = item // (par.page_size * len(heads))
        for t in range(par.page_size):
            for g in range(heads.start, heads.stop, unit):
                yield Field(key=(FieldKind.KV, key, t * par.kv_heads + g),
                            offset=(t * len(heads) + g - heads.start) * hb, nbytes=unit * hb)
    elif par.state_tp == peer.state_tp:
        yield Field(key=(FieldKind.OPAQUE, key, rank), offset=0, nbytes=item)
    else:
        tp = par.state_tp
        blocks = shape.sub or (shape.dim * tp,)
        total = sum(blocks)
        lcm = math.lcm(tp, peer.state_tp)
        per_dim = item // (shape.dim * shape.outer)
        for row in range(shape.outer):
            local_base = row * shape.dim
            global_base = row * total
            for j, full in enumerate(blocks):
                mine = full // tp
                unit = full // lcm
                comp = (_CONV_SUB[j] if len(blocks) == 3 else FieldKind.CONV_V) if shape.conv \
                    else FieldKind.SSM
                for g in range(rank * mine, (rank + 1) * mine, unit):
                    yield Field(key=(comp, key, global_base + g),
                                offset=(local_base + g - rank * mine) * per_dim, nbytes=unit * per_dim)
                local_base += mine
                global_base += full


def field_layout(side: AdoptedLayout, *, peer: Parallel) -> Layout:
    """`side`'s own rank as a keyed Layout over its adopted regions (NIXL registered those)."""
    rank = side.parallel.attn_rank
    groups: dict[int, dict[int, list[Field]]] = {}
    for b in side.buffers:
        region, base = side.placement[b.key]
        fields = groups.setdefault(b.group_id, {}).setdefault(region, [])
        fields.extend(f.shifted(base) for f in buffer_fields(side, b.key, rank=rank, peer=peer))
    return Layout(
        geometry=None, tp=side.parallel.attn_tp, rank=rank, regions=side.layout.regions,
        groups=tuple(
            GroupLayout(group_id=GroupId(g), kind=None, layer_indices=(), block_tokens=None,
                        placements=tuple(Placement(region_id=r, fields=tuple(sorted(fs, key=lambda f: f.offset)))
                                         for r, fs in sorted(by_region.items())))
            for g, by_region in sorted(groups.items())),
    )


def held_keys(side: AdoptedLayout, *, rank: int, peer: Parallel, only: set[int] | None = None) -> set[FieldKey]:
    """Field keys of `side`'s rank `rank` (of the buffers in `only`, when given)."""
    return {f.key for b in side.buffers if only is None or b.key in only
            for f in buffer_fields(side, b.key, rank=rank, peer=peer)}


# --------------------------------------------------------------------------- per peer


@dataclass(frozen=True, kw_only=True)
class PeerPlan:
    """What this prefill rank writes into one decode rank."""

    #: per fencing component; None where this rank writes none of its fields (another rank does)
    planners: dict[Component, TransferPlanner | None]
    sources: tuple[int, ...]  # the prefill ranks the decode rank reads
    readers: int  # decode ranks that read each of those prefill ranks
    fields: int  # fields this rank writes per block
    decode_fields: int  # fields the decode rank holds per block (of the buffers both sides have)
    #: buffers one side has and the other has not, tolerated and not transferred (in words, to log)
    one_sided: tuple[str, ...] = ()
    #: per fencing component, the fields this rank writes (staged_kv.py checks the decode's own reckoning)
    keys: dict[Component, frozenset[FieldKey]] = dataclasses.field(default_factory=dict)


def plan_peer(local: AdoptedLayout, peer: AdoptedLayout) -> PeerPlan:
    """Planners from this prefill rank to a decode rank; ValueError (naming values) if they cannot pair."""
    notes = check_pair(local, peer)
    p, d = local.parallel, peer.parallel
    both = {b.key for b in local.buffers} & {b.key for b in peer.buffers}
    sources, readers = prefill_sources(p.attn_tp, d.attn_tp, d.attn_rank)
    if p.attn_rank not in sources:
        raise ValueError(f"decode rank {d.attn_rank}/{d.attn_tp} reads prefill ranks {list(sources)}; "
                         f"this is prefill rank {p.attn_rank}/{p.attn_tp}")
    wanted = held_keys(peer, rank=d.attn_rank, peer=p, only=both)
    holders = [(r, held_keys(local, rank=r, peer=d)) for r in sources]
    mine: set[FieldKey] = set()
    for k in wanted:
        writer = next((r for r, keys in holders if k in keys), None)
        if writer is None:
            raise ValueError(f"no prefill rank of {list(sources)} holds field {k[0].value} of buffer {k[1]} "
                             f"at {k[2]} that decode rank {d.attn_rank} holds")
        if writer == p.attn_rank:
            mine.add(k)
    src, dst = field_layout(local, peer=d), field_layout(peer, peer=p)
    planners: dict[Component, TransferPlanner | None] = {}
    comp_keys: dict[Component, frozenset[FieldKey]] = {}
    for comp, buffers in local.components:
        keys = frozenset(k for k in mine if k[1] in buffers)
        comp_keys[comp] = keys
        planners[comp] = TransferPlanner(src, dst, keys=keys) if keys else None
    return PeerPlan(planners=planners, sources=sources, readers=readers, fields=len(mine), decode_fields=len(wanted),
                    one_sided=notes, keys=comp_keys)
