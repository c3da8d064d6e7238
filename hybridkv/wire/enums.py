"""The enumerations that travel on the wire as ints: message kinds and field values.

The numbers are the protocol: never renumber a member, only add new ones.
"""

from __future__ import annotations

import enum


class Kind(enum.IntEnum):
    """What a message is. Each member has exactly one message type, declared with
    ``@message(Kind.X)`` in :mod:`hybridkv.wire.messages`."""

    HELLO = 1
    REFUSE = 2
    EXPORT = 3
    IMPORT = 4
    DONE = 5
    FAILURE = 6
    HEARTBEAT = 7
    LEASE = 8
    BYE = 9
    WANT = 10
    AUTH = 11  # protocol 2: before any Hello


class Role(enum.IntEnum):
    PRODUCER = 1  # prefill: owns the blocks to be read / pushes them
    CONSUMER = 2  # decode: pulls them / offers blocks to be written


class Mode(enum.IntEnum):
    PULL = 1  # consumer READs (default)
    PUSH = 2  # producer WRITEs


class Mem(enum.IntEnum):
    DRAM = 1
    VRAM = 2


class FailureCode(enum.IntEnum):
    TRANSFER_ERROR = 1
    LEASE_EXPIRED = 2
    UNKNOWN_REQUEST = 3
    ABORTED = 4
    PROTOCOL = 5
    CLAIMED = 6  # another consumer already reads the request


__all__ = ["FailureCode", "Kind", "Mem", "Mode", "Role"]
