"""Free TCP ports for tests that start listeners in other processes.

A port a test picks is bound by another process seconds later (after vLLM's import), so it must
stay free meanwhile. Ports the kernel hands to bind(0) come from the ephemeral range, which every
outgoing connection on the host draws from too; two picks can also overlap (one block's port + 1
is the next block's port). So blocks come from below the ephemeral range, are checked on every
interface (the UCX listener listens on all of them), and never overlap within one test process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_taken: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(n: int = 1) -> int:
    """The first of ``n`` consecutive ports, each free on every interface now, none handed out
    before by this process."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(max(1024, low - 16000), low - n)
        block = range(base, base + n)
        if _taken.intersection(block):
            continue
        socks = []
        try:
            for port in block:
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        _taken.update(block)
        return base
    raise RuntimeError(f"no {n} consecutive free ports below the ephemeral range (from {low})")
