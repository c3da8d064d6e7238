"""Where hybridkv's post-to-landed time goes on the GPU host (issue 49 item 4), as a wrapper around
`hybridkv bench transfer`: the same run, with timers around NIXL's two posting calls (wall and thread CPU) in
hybridkv's path and in the bare baselines, and every poll of hybridkv's wait.

    python tools/device/post_probe.py bench transfer --mem vram --tokens 8192 --iters 15 --json

prints the bench's JSON on stdout and, on stderr, one line per segment (median over the kept rounds):
hybridkv's posting window (the function DataPlane.ready returns), make_prepped_xfer and transfer in hybridkv's path and in the bare
one-span READ ("raw") and plan ("plan", 2 indices), the polls of hybridkv's wait (how many, the gap between
two, the last IN_PROGRESS poll to DONE). Off-CPU time in a call (wall - CPU) is time the thread waited: for
the GIL, a lock, or the scheduler.

Knobs (environment, for A/B runs on one host):
  PROBE_BARE_SPIN_US=N   busy-spin N us before each bare post (is a post after a sleep slow because the core is cold?)
  PROBE_UCXX_TLS=tcp,self  the control plane's ucxx context made with these UCX transports only (no CUDA in it)
  PROBE_NOTIFIER=nowait  ucxx's notifier thread does not wait for the event loop to have run the completions it
                         handed over (ucxx waits up to 10 ms): it goes back to its wait at once
  PROBE_PREPOST=spin:N   right before each post of hybridkv's fetch and of (a'') (after re-planning), busy-spin N us
                         (is the core slow to wake, or slowed by what ran?): read transfer()'s CPU, not landed
  PROBE_PREPOST=warm     the same place, one page READ posted and waited for first (are NIXL/UCX/CUDA's posting
                         code and data cold?): read transfer()'s CPU, not landed
  PROBE_PREPOST=early    that READ at the start of each fetch instead, before its Want goes out (does the posting
                         path stay warm through the Exports' arrival and planning?); early_nowait: posted, not
                         waited for there (released after the fetch)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

REC: dict[str, list[tuple[float, float]]] = {}
WAITS: list[tuple[int, float, float]] = []  # (polls, median gap, last IN_PROGRESS poll -> DONE poll)
_IN_DP = [False]
_TAG = [""]  # the bare post's name while (a'') posts; "-" while PROBE_PREPOST's warm-up READ does (not recorded)


def _add(name: str, w: float, c: float) -> None:
    REC.setdefault(name, []).append((w, c))


def _patch() -> None:
    import hybridkv.benchmarks.transfer.measure as measure
    import hybridkv.transport.dataplane as dpm
    from hybridkv.transport.consumer import Consumer
    from hybridkv.transport.nixl_shim import load_nixl

    api = load_nixl()
    agent_cls = api.nixl_agent
    make0, xfer0 = agent_cls.make_prepped_xfer, agent_cls.transfer

    def tag(li) -> str:
        if _TAG[0]:
            return _TAG[0]
        return "hybridkv" if _IN_DP[0] else {1: "raw", 2: "plan"}.get(len(li), f"bare{len(li)}")

    def make(self, op, lh, li, rh, ri, *a, **k):
        w, c = time.perf_counter(), time.thread_time()
        h = make0(self, op, lh, li, rh, ri, *a, **k)
        make.last = tag(li)
        if make.last != "-":
            _add(f"make {make.last}", time.perf_counter() - w, time.thread_time() - c)
        return h

    def transfer(self, h, *a, **k):
        w, c = time.perf_counter(), time.thread_time()
        s = xfer0(self, h, *a, **k)
        if make.last != "-":
            _add(f"transfer {make.last}", time.perf_counter() - w, time.thread_time() - c)
        return s

    make.last = "?"
    agent_cls.make_prepped_xfer, agent_cls.transfer = make, transfer

    ready0, state0 = dpm.DataPlane.ready, dpm.DataPlane.state
    prepost = _prepost()
    polls: list[tuple[float, object]] = []

    def ready(self, *a, **k):  # hybridkv's posts: Importer checks them (DataPlane.ready), then calls each
        go0 = ready0(self, *a, **k)

        def go():
            prepost(self, a[1])
            w, c = time.perf_counter(), time.thread_time()
            _IN_DP[0] = True
            try:
                x = go0()
            finally:
                _IN_DP[0] = False
            post.exit = time.perf_counter()
            WINDOWS.append((w, post.exit))
            AFTER.append([post.exit, None])
            _add("DataPlane.post", post.exit - w, time.thread_time() - c)
            polls.clear()
            return x

        return go

    def post():
        pass

    def state(self, xfer):
        if AFTER and AFTER[-1][1] is None:
            AFTER[-1][1] = time.perf_counter()
        s = state0(self, xfer)
        polls.append((time.perf_counter(), s))
        if s is not dpm.XferState.IN_PROGRESS and len(polls) >= 1:
            ts = [t for t, _ in polls]
            gaps = [b - a for a, b in zip(ts, ts[1:])]
            WAITS.append((len(polls), statistics.median(gaps) if gaps else 0.0,
                          gaps[-1] if gaps else 0.0, ts[0] - post.exit))
        return s

    dpm.DataPlane.ready, dpm.DataPlane.state = ready, state
    fetch0 = Consumer.fetch
    early = os.environ.get("PROBE_PREPOST", "").startswith("early")
    wait = os.environ.get("PROBE_PREPOST") == "early"

    async def fetch(self, *a, **k):  # the whole fetch timed: does a step before the post only move its cost?
        dp = self.dp
        w = time.perf_counter()
        h = prepost.warm(dp.agent, dp._local, dp._peers[self.peer.agent].prepped, wait) if early else None
        try:
            return await fetch0(self, *a, **k)
        finally:
            _add("whole fetch", time.perf_counter() - w, 0.0)
            if h is not None:
                while dp.agent.check_xfer_state(h) == "PROC":
                    pass
                dp.agent.release_xfer_handle(h)

    Consumer.fetch = fetch

    spin = float(os.environ.get("PROBE_BARE_SPIN_US", "0")) / 1e6
    timed0 = measure._timed
    # (a'') re-plans, checks the plan, asks for the prepped lists, then posts: a check right before the
    # lists marks the next bare post as (a'')'s
    from hybridkv.transport.plan import TransferPlan

    check0, prepped0 = TransferPlan.check, dpm.DataPlane.prepped
    cold = [0.0, False]

    def check(self):
        cold[0] = time.perf_counter()
        return check0(self)

    def prepped(self, peer):
        cold[1] = time.perf_counter() - cold[0] < 1e-3
        return prepped0(self, peer)

    def timed(agent, op, lh, li, rh, ri, *a, **k):
        if spin:
            _spin(spin)
        if not cold[1]:
            return timed0(agent, op, lh, li, rh, ri, *a, **k)
        cold[1] = False
        prepost.bare(agent, lh, rh)
        _TAG[0] = "plan_cold"
        try:
            return timed0(agent, op, lh, li, rh, ri, *a, **k)
        finally:
            _TAG[0] = ""

    TransferPlan.check, dpm.DataPlane.prepped, measure._timed = check, prepped, timed

    _patch_notifier()
    tls = os.environ.get("PROBE_UCXX_TLS")
    if tls:
        import hybridkv.transport.ucxx_context as uc

        ctx0 = uc.context

        def context(ucxx):
            if ucxx.core._ctx is None:
                ucxx.init(options={"TLS": tls})
            return ctx0(ucxx)

        uc.context = context


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _prepost():
    """PROBE_PREPOST's step before a post (hybridkv's, and (a'')'s through ``.bare``): nothing, a busy-spin,
    or one page READ posted and waited for (prepped-list entry 0 both sides: a page the fetch reads anyway)."""
    import numpy as np

    what = os.environ.get("PROBE_PREPOST", "")
    zero = np.zeros(1, np.int32)

    def warm(agent, lh, rh, wait: bool = True):
        tag, _TAG[0] = _TAG[0], "-"
        try:
            h = agent.make_prepped_xfer("READ", lh, zero, rh, zero, b"")
            agent.transfer(h)
            if not wait:
                return h
            while agent.check_xfer_state(h) == "PROC":
                pass
            agent.release_xfer_handle(h)
            return None
        finally:
            _TAG[0] = tag

    def bare(agent, lh, rh) -> None:
        if what.startswith("spin:"):
            _spin(float(what[5:]) / 1e6)
        elif what == "warm":
            warm(agent, lh, rh)

    def step(dp, peer) -> None:
        if what:  # the lists themselves: DataPlane.prepped is timed above as (a'')'s mark
            bare(dp.agent, dp._local, dp._peers[peer].prepped)

    step.bare, step.warm = bare, warm
    return step


NOTIFIER: list[tuple[float, float]] = []  # stretches of the notifier thread's Python (GIL held, but for a wait to get it)
WINDOWS: list[tuple[float, float]] = []  # hybridkv's DataPlane.post calls (entry, exit)
AFTER: list[list] = []  # [DataPlane.post's exit, the wait's first poll]


def _patch_notifier() -> None:
    """ucxx's notifier thread (Python futures on) as ucxx 0.52 runs it, timestamped: any stretch of it inside
    a hybridkv post window ran with the GIL while the posting thread had let go of it."""
    import asyncio
    from concurrent.futures import TimeoutError as FutTimeout

    import ucxx._lib.libucxx as ucx_api
    import ucxx._lib_async.application_context as ac
    from ucxx._lib_async.notifier_thread import _run_request_notifier

    nowait = os.environ.get("PROBE_NOTIFIER") == "nowait"

    def notifier(event_loop, worker, q):
        asyncio.set_event_loop(event_loop)
        while True:
            a = time.perf_counter()  # holds the GIL: back from its last wait, or from task.result
            worker.populate_python_futures_pool()
            NOTIFIER.append((a, time.perf_counter()))
            state = worker.wait_request_notifier(period_ns=int(1e9))
            a = time.perf_counter()
            stop = not q.empty() and q.get() == "shutdown"
            if state == ucx_api.PythonRequestNotifierWaitState.Shutdown or stop:
                break
            if state == ucx_api.PythonRequestNotifierWaitState.Timeout:
                continue
            task = asyncio.run_coroutine_threadsafe(_run_request_notifier(worker), event_loop)
            NOTIFIER.append((a, time.perf_counter()))
            if nowait:  # back to its wait at once: its next Python runs while the loop is idle, not mid-post
                continue
            try:
                task.result(0.01)
            except FutTimeout:
                pass
            except Exception:
                pass
        worker.clear_python_futures_pool()

    ac._notifierThread = notifier


def _report() -> None:
    med = statistics.median
    print(f"post_probe: pid {os.getpid()}, threads at exit {len(sys._current_frames())}, "
          f"PROBE_BARE_SPIN_US={os.environ.get('PROBE_BARE_SPIN_US', '0')} PROBE_UCXX_TLS="
          f"{os.environ.get('PROBE_UCXX_TLS', '')} UCXPY_ENABLE_PYTHON_FUTURE="
          f"{os.environ.get('UCXPY_ENABLE_PYTHON_FUTURE', '')} PROBE_PREPOST={os.environ.get('PROBE_PREPOST', '')}",
          file=sys.stderr)
    for name in sorted(REC):
        v = REC[name][1:]  # the first is the warm-up round's
        if v:
            w, c = med(x for x, _ in v) * 1e6, med(y for _, y in v) * 1e6
            print(f"post_probe: {name:<28} wall {w:8.1f} us  cpu {c:8.1f} us  off-CPU {w - c:7.1f} us  n={len(v)}",
                  file=sys.stderr)
    inside = []
    for a, b in WINDOWS[1:]:
        inside.append(sum(min(b, y) - max(a, x) for x, y in NOTIFIER if x < b and y > a))
    if inside:
        print(f"post_probe: notifier thread ran inside hybridkv's DataPlane.post in {sum(1 for t in inside if t > 0)} "
              f"of {len(inside)} posts, median {med(inside) * 1e6:.1f} us, max {max(inside) * 1e6:.1f} us; "
              f"{len(NOTIFIER)} notifier wake-ups in all", file=sys.stderr)
    after = []
    for a, b in AFTER[1:]:
        if b is not None:
            after.append(sum(min(b, y) - max(a, x) for x, y in NOTIFIER if x < b and y > a))
    if after:
        print(f"post_probe: notifier thread ran between DataPlane.post's return and the first poll in "
              f"{sum(1 for t in after if t > 0)} of {len(after)} fetches, median {med(after) * 1e6:.1f} us, "
              f"max {max(after) * 1e6:.1f} us", file=sys.stderr)
    if len(WAITS) > 1:
        v = WAITS[1:]
        print(f"post_probe: hybridkv wait: polls {med(p for p, *_ in v):.0f}, gap between polls "
              f"{med(g for _, g, *_ in v) * 1e6:.1f} us, last IN_PROGRESS -> DONE {med(x for *_, x, _ in v) * 1e6:.1f} us, "
              f"post return -> first poll {med(f for *_, f in v) * 1e6:.1f} us", file=sys.stderr)


if __name__ == "__main__":
    _patch()
    import atexit

    atexit.register(_report)
    from hybridkv.cli import main

    sys.exit(main())
