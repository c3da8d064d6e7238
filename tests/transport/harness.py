"""Start producer/consumer processes and collect what they report."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time

from tests.transport import peers

CTX = mp.get_context("spawn")


class Proc:
    def __init__(self, target, opts):
        self.out, self.inbox = CTX.Queue(), CTX.Queue()
        self.p = CTX.Process(target=target, args=(opts, self.out, self.inbox), daemon=True)
        self.p.start()
        self.got: dict[str, object] = {}

    def expect(self, kind: str, timeout: float = 60.0):
        if kind in self.got:
            return self.got.pop(kind)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                k, v = self.out.get(timeout=0.1)
            except queue.Empty:
                if not self.p.is_alive() and self.out.empty():
                    raise AssertionError(f"process exited ({self.p.exitcode}) before reporting {kind!r}")
                continue
            if k == "error":
                raise AssertionError(f"peer process failed:\n{v}")
            if k == kind:
                return v
            self.got[k] = v
        raise AssertionError(f"no {kind!r} within {timeout} s (have {sorted(self.got)})")

    def send(self, word: str) -> None:
        self.inbox.put(word)

    def signal(self, sig) -> None:
        os.kill(self.p.pid, sig)

    def stop(self) -> None:
        self.send("stop")
        self.p.join(10)
        if self.p.is_alive():
            self.p.kill()
            self.p.join(5)


def producer(**opts) -> Proc:
    return Proc(peers.producer_main, opts)


def consumer(addr, **opts) -> Proc:
    return Proc(peers.consumer_main, {"addr": addr, **opts})


def nixl_available() -> bool:
    """Whether this environment can load NIXL (the tests that post through it skip otherwise)."""
    try:
        from hybridkv.transport.nixl_shim import load_nixl

        load_nixl()
    except ImportError:
        return False
    return True
