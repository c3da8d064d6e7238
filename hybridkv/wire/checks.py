"""Checks against what a peer has: the block ids it may touch, and compatibility.

:func:`check_blocks` keeps a peer to the blocks it was given;
:func:`compat_hash` covers everything both sides must agree on and
:func:`compat_differences` names what differs, so a refusal says why.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import msgpack

from hybridkv.errors import Difference
from hybridkv.wire.limits import WireError
from hybridkv.wire.regions import GroupBlocks


# ---------------------------------------------------------------- checks against what a peer has
def check_blocks(blocks: tuple[GroupBlocks, ...], allowed: Mapping[int, Any], *, what: str) -> None:
    """Every id must be in ``allowed[group]`` (a set, or an int bound: ids < bound).

    Raises :class:`WireError` naming the first offending group and ids, so a peer
    can touch only what it was given.
    """
    for g in blocks:
        if g.group_id not in allowed:
            raise WireError(f"{what}: group {g.group_id} was not given; expected one of {sorted(allowed)}")
        ok = allowed[g.group_id]
        if isinstance(ok, int):
            bad = [b for b in g.ids if b >= ok]
            bound = f"ids < {ok}"
        else:
            bad = [b for b in g.ids if b not in ok]
            bound = "ids it was given"
        if bad:
            raise WireError(f"{what}: group {g.group_id} block ids {bad[:8]} are out of bounds; expected {bound}")


# ---------------------------------------------------------------- compatibility
def compat_hash(fields: Mapping[str, str]) -> bytes:
    """sha256 over the canonical (sorted) fields, which include the protocol version."""
    canon = msgpack.packb(sorted(fields.items()), use_bin_type=True)
    return hashlib.sha256(canon).digest()


def compat_differences(local: Mapping[str, str], remote: Mapping[str, str]) -> tuple[Difference, ...]:
    keys = sorted(set(local) | set(remote))
    return tuple(Difference(field=k, local=local.get(k), remote=remote.get(k))
                 for k in keys if local.get(k) != remote.get(k))


__all__ = ["check_blocks", "compat_differences", "compat_hash"]
