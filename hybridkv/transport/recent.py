"""A map of the last few entries only: what a long-lived server remembers of its peers' ids and nonces."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Recent(OrderedDict[K, V]):
    """At most ``limit`` entries, the least recently set dropped first: setting a key (new or not) makes
    it the newest. A server runs for ever; what it keeps about each peer, request or nonce must not."""

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit = {limit!r}; expected an int >= 1")
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


__all__ = ["Recent"]
