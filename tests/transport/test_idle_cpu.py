"""A connected control plane at rest costs a fraction of a core, and no process hangs at exit.

ucxx polled every pending request from the event loop (a connected producer and consumer at rest used
99% and 98% of a core each); with its python futures (``UCXPY_ENABLE_PYTHON_FUTURE``, one of
apply_ucx_defaults) a channel waiting for its next frame costs nothing, and the notifier thread that
brings is stopped at close and at exit (transport/control.py). Real processes, real NIXL and ucxx.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.transport import idle_peers
from tests.transport.harness import Proc, nixl_available

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")

#: Far below a spinning process (a core each, or whatever share of a loaded 2-core box it gets) and far
#: above what the pump and UCX's progress thread cost at rest (~5% each on the CPU box).
MAX_IDLE_SHARE = 0.30
WINDOW_S = 1.5


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process so far (/proc/<pid>/stat utime + stime)."""
    with open(f"/proc/{pid}/stat") as f:
        cols = f.read().rsplit(")", 1)[1].split()
    return (int(cols[11]) + int(cols[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_connected_pair_at_rest_costs_a_fraction_of_a_core():
    prod = Proc(idle_peers.producer_main, {})
    cons = None
    try:
        _, port, _ = prod.expect("addr")
        cons = Proc(idle_peers.consumer_main, {"addr": ("127.0.0.1", port)})
        pids = {"consumer": cons.expect("connected"), "producer": prod.expect("connected")}
        time.sleep(0.3)  # the handshake's last frames and the first pump rounds done
        t0, before = time.monotonic(), {k: _cpu_s(p) for k, p in pids.items()}
        time.sleep(WINDOW_S)
        used = {k: (_cpu_s(p) - before[k]) / (time.monotonic() - t0) for k, p in pids.items()}
        assert all(share < MAX_IDLE_SHARE for share in used.values()), \
            f"share of a core used at rest: {used}; expected each below {MAX_IDLE_SHARE}"
        # ... and both close and exit promptly (the notifier thread stopped with the control plane)
        t1 = time.monotonic()
        for p in (cons, prod):
            p.send("stop")
        for p in (cons, prod):
            p.p.join(20)
        assert (cons.p.exitcode, prod.p.exitcode) == (0, 0), (cons.p.exitcode, prod.p.exitcode)
        assert time.monotonic() - t1 < 15
    finally:
        for p in (cons, prod):
            if p is not None and p.p.is_alive():
                p.p.kill()


# ------------------------------------------------------------ exit without close
# Each probe prints the monotonic time its main code ended; the process must be gone soon after,
# whether or not it closed anything (ucxx's notifier thread is not a daemon).
_LISTEN_AND_LEAVE = """
import asyncio, time
from hybridkv.transport import control

async def main():
    async def handler(ch):
        pass
    global listener
    listener = control.listen(handler, port=0)  # never closed

asyncio.run(main())
print("ENDED", time.monotonic(), flush=True)
"""

_CONNECT_AND_LEAVE = """
import asyncio, time
from tests.transport import idle_peers

async def main():
    global prod, cons
    prod = idle_peers._endpoint("producer", 1)
    _, port = await prod.start()
    cons = idle_peers._endpoint("consumer", 2)
    await cons.connect("127.0.0.1", port)  # neither closed

# On the main thread, as the reference engine and the test peers run it: a thread started from it is
# not a daemon (on the vLLM worker's daemon loop thread ucxx's notifier inherits daemon=True).
asyncio.run(main())
print("ENDED", time.monotonic(), flush=True)
"""

_TWO_LOOPS = """
import asyncio, time
from hybridkv.transport import control
from hybridkv import wire

async def first():
    global kept
    async def handler(ch):
        pass
    kept = control.listen(handler, port=0)  # left open on a loop that then ends

async def second():
    got = asyncio.get_running_loop().create_future()
    async def handler(ch):
        got.set_result(await ch.recv())
    listener = control.listen(handler, port=0)
    ch = await control.dial("127.0.0.1", int(listener.port), 10.0)
    await ch.send(wire.Bye(reason="second loop"))
    print("GOT", (await asyncio.wait_for(got, 10)).reason, flush=True)
    await ch.close()
    listener.close()

asyncio.run(first())
asyncio.run(second())
print("ENDED", time.monotonic(), flush=True)
"""


_CLOSE_STOPS_IT = """
import asyncio, threading, time
import ucxx
from tests.transport import idle_peers

def notifiers():
    return sum(t.name == "UCX-Py Async Notifier Thread" for t in threading.enumerate())

async def pair(seed):
    prod = idle_peers._endpoint("producer", seed)
    _, port = await prod.start()
    cons = idle_peers._endpoint("consumer", seed + 1)
    await cons.connect("127.0.0.1", port)
    return prod, cons

async def main():
    prod, cons = await pair(1)
    print("OPEN", notifiers(), ucxx.core._ctx is not None, flush=True)
    await cons.close()
    print("ONE CLOSED", notifiers(), flush=True)  # the producer's listener still uses it
    await prod.close()
    print("CLOSED", notifiers(), ucxx.core._ctx is None, flush=True)
    prod, cons = await pair(3)  # the same loop again: a fresh context
    print("AGAIN", notifiers(), flush=True)
    await cons.close()
    await prod.close()

asyncio.run(main())
print("ENDED", time.monotonic(), flush=True)
"""


def _probe(code: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_WARN_UNUSED_ENV_VARS": "n"}
    env.pop("UCXPY_ENABLE_PYTHON_FUTURE", None)  # hybridkv's default, as a deployment gets it
    for attempt in (1, 2):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=150)
        gone = time.monotonic()
        # What is checked here starts at ENDED (the exit). A native crash before it, while two NIXL/UCX agents
        # start in one process (seen once, SIGSEGV right after an agent's init, on a loaded 2-core CI run), is
        # not that; it is tried once more and reported if it happens again.
        if out.returncode >= 0 or "ENDED " in out.stdout or attempt == 2:
            break
        print(f"probe died by signal {-out.returncode} before its code ended; once more", file=sys.stderr)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    ended = [float(line.split()[1]) for line in lines if line.startswith("ENDED ")]
    assert ended, out.stdout[-2000:] + out.stderr[-2000:]
    assert gone - ended[0] < 5.0, f"the process took {gone - ended[0]:.1f} s to exit after its code ended"
    return lines


def test_a_process_that_listens_and_never_closes_exits():
    _probe(_LISTEN_AND_LEAVE)


def test_a_process_that_connects_and_never_closes_exits():
    _probe(_CONNECT_AND_LEAVE)


def test_a_second_event_loop_gets_a_working_control_plane():
    """ucxx's futures are bound to the loop its context was made on: once that loop ended (with a
    listener left open on it), the next listen or dial on a new loop gets a fresh context."""
    assert "GOT second loop" in _probe(_TWO_LOOPS)


def test_closing_the_last_endpoint_stops_the_notifier_thread():
    """What a start made, the closes stop: once the producer and the consumer are closed, ucxx's notifier
    thread is gone and its context dropped; the next start on the same loop gets a working one."""
    lines = _probe(_CLOSE_STOPS_IT)
    assert [line for line in lines if line.split()[0] in ("OPEN", "ONE", "CLOSED", "AGAIN")] == \
        ["OPEN 1 True", "ONE CLOSED 1", "CLOSED 0 True", "AGAIN 1"], lines
