"""The protocol version, the limits a message from a peer must stay within, and
:class:`WireError`, raised for bytes that do not.

Every length a peer controls has a bound here, so a hostile message costs at
most what these allow before it is refused.
"""

from __future__ import annotations

from hybridkv.errors import HybridKVError

# 2: the handshake authenticates both peers (Auth) before any Hello, and every message about one
# request carries that request's capability token.
# 3: the proofs bind the connection (the address dialled, the producer's own, both agent names), the
# consumer proves first, and every frame after the proofs carries a MAC under the session's key.
# 4: Want may ask for staging and Export may name a staging slot (heterogeneous TP, transport/staging.py).
# 5: Want names the fields to stage (a mask; empty: every field), so a producer packs only what its reader reads.
PROTOCOL_VERSION = 5

MAX_MESSAGE_BYTES = 16 << 20
# Frames a peer may send before it proved the shared secret (its Auth messages): a few KiB,
# so an unauthenticated connection costs the listener next to nothing.
MAX_PREAUTH_BYTES = 4 << 10
NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256
MAC_BYTES = 32  # HMAC-SHA256 under the session key, after each sealed frame's body
TOKEN_BYTES = 16  # a request's capability: secrets.token_bytes, 128 bits
MAX_METADATA_BYTES = 4 << 20
MAX_NAME = 256
MAX_TEXT = 4096
MAX_COMPAT_FIELDS = 64
MAX_COMPAT_NAME = 64  # a compatibility field's name (also in a refusal's differences)
MAX_REGIONS = 4096
MAX_GROUPS = 1024
MAX_BLOCKS_PER_GROUP = 1 << 22
MAX_REQUESTS_PER_HEARTBEAT = 1024  # a consumer renews more in several heartbeats
MAX_READERS = 1024
MAX_TP = 1 << 16
MAX_LAYERS = 65536
MAX_FIELDS = 1 << 20  # rows of all of a layout's field tables together
MAX_STAGE_MASK = MAX_FIELDS // 8  # a Want's field mask: a bit per field the pair shares
MAX_ADDR = (1 << 64) - 1
MAX_I32 = (1 << 31) - 1
MAX_I63 = (1 << 63) - 1
MAX_LEASE_S = 86400.0


class WireError(ValueError, HybridKVError):
    """Bytes from a peer that are not a valid message."""


__all__ = [
    "MAX_ADDR", "MAX_BLOCKS_PER_GROUP", "MAX_COMPAT_FIELDS", "MAX_COMPAT_NAME", "MAX_FIELDS", "MAX_GROUPS",
    "MAX_I32", "MAX_I63", "MAX_LAYERS", "MAX_LEASE_S", "MAX_MESSAGE_BYTES", "MAX_METADATA_BYTES", "MAX_NAME", "MAX_PREAUTH_BYTES", "NONCE_BYTES", "PROOF_BYTES", "MAC_BYTES", "TOKEN_BYTES",
    "MAX_READERS", "MAX_REGIONS", "MAX_STAGE_MASK", "MAX_REQUESTS_PER_HEARTBEAT", "MAX_TEXT", "MAX_TP", "PROTOCOL_VERSION", "WireError",
]
