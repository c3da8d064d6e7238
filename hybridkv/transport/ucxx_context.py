"""ucxx's context for the control plane (transport/control.py): its event loop, its notifier thread, its end.

ucxx waits for a request either by polling it from the event loop (``asyncio.sleep(0)`` until it
completes) or on a Python future its notifier thread completes. Every connected channel at rest waits
for its next frame, so polling kept a core busy per process; hybridkv turns the futures on
(``UCXPY_ENABLE_PYTHON_FUTURE``, an env default, :mod:`hybridkv.transport.env`) and owns what that brings:
the notifier thread is not a daemon and is bound to the event loop ucxx's context was made on.
:func:`release` (an endpoint's close) stops it and drops the context once no listener or channel is
open; an exit hook stops it before the interpreter waits for its threads, so a process that never
closes still exits; a context whose loop has ended is replaced at the next listen or dial.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import weakref

log = logging.getLogger(__name__)

# (weak ref to the context hybridkv made, the loop it was made on); None: none made yet
_CTX: tuple[weakref.ref, asyncio.AbstractEventLoop] | None = None
# Listeners and channels of this process (anything with ``closed``): released once none is open.
_OPEN: weakref.WeakSet = weakref.WeakSet()
_DIALING = 0  # dials in flight (no channel yet): their endpoint waits on the context too
_EXIT_GUARDED = False


def context(ucxx):
    """ucxx's context for the running loop: made here (so its notifier thread is bound to this loop),
    or the current one; one whose loop has ended is replaced, everything on it having ended with it."""
    global _CTX
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no loop: ucxx makes one of its own, as it always did
        return ucxx.core._get_ctx()
    ctx = ucxx.core._ctx
    if ctx is not None and _CTX is not None and _CTX[0]() is ctx and _CTX[1] is not loop \
            and ctx.enable_python_future:
        if _CTX[1].is_running():
            raise RuntimeError(f"hybridkv's control plane runs on one event loop per process: ucxx's request "
                               f"futures are bound to {_CTX[1]!r}, still running, and this call runs on {loop!r} "
                               "(or set UCXPY_ENABLE_PYTHON_FUTURE=0: any loop, a core busy per process)")
        _retire(ucxx)
        ctx = None
    if ctx is None:
        ctx = ucxx.core._get_ctx()
        _CTX = (weakref.ref(ctx), loop)
    return ctx


def _stop_notifier(ctx) -> None:
    """Stop the context's notifier thread (python futures), if it runs: at once, not at its next
    1 s wake-up. Nothing waiting on a future of this context completes afterwards."""
    if getattr(ctx, "notifier_thread", None) is None:
        return
    stop = getattr(ctx.worker, "stop_request_notifier_thread", None)  # without it: the thread ends within 1 s
    if stop is not None:
        stop()  # ends its wait now
    ctx.stop_notifier_thread()
    if stop is not None:
        stop()  # that wait marked it running again as it woke: stopped for good (the worker's destructor warns)


def _retire(ucxx) -> None:
    """Stop the context's notifier thread and drop the context (ucxx makes a new one when next used)."""
    global _CTX
    ctx = ucxx.core._ctx
    _CTX = None
    if ctx is None:
        return
    _stop_notifier(ctx)
    try:
        ucxx.reset()
    except Exception:  # something still holds it (an endpoint never closed): it is not used again
        ucxx.core._ctx = None
        # Progress is started once per event loop, in ucxx's table: the next context on this loop
        # needs its own (the old entry goes with its context otherwise, which is still held).
        from ucxx._lib_async.application_context import clear_progress_tasks

        clear_progress_tasks()


def release() -> bool:
    """Stop ucxx's notifier thread and drop its context when nothing of this process's control plane
    is open (no listener, no channel); True when it did. Every endpoint's close calls it; a context
    hybridkv did not make is left alone."""
    ucxx = sys.modules.get("ucxx")
    if ucxx is None or _CTX is None or _CTX[0]() is None or _CTX[0]() is not ucxx.core._ctx:
        return False
    if _DIALING or any(not x.closed for x in _OPEN):
        return False
    _retire(ucxx)
    log.debug("ucxx context released: no control-plane listener or channel open")
    return True


def _stop_at_exit() -> None:
    ucxx = sys.modules.get("ucxx")
    ctx = None if ucxx is None else getattr(ucxx.core, "_ctx", None)
    if ctx is not None:
        try:
            _stop_notifier(ctx)
        except Exception:  # pragma: no cover - exiting: never raise
            pass


def guard_exit() -> None:
    """Once per process: stop ucxx's notifier thread when the interpreter exits, before it waits for
    its non-daemon threads (that thread among them). ``atexit`` runs only after that wait, too late;
    threading's own exit hooks (``concurrent.futures`` uses them) run before it."""
    global _EXIT_GUARDED
    if _EXIT_GUARDED:
        return
    _EXIT_GUARDED = True
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(_stop_at_exit)
    except RuntimeError:  # interpreter already exiting, or no such hook: the closes still stop it
        import atexit

        atexit.register(_stop_at_exit)


def opened(thing) -> None:
    """A listener or channel now open on the context: :func:`release` waits until it is closed."""
    _OPEN.add(thing)


@contextlib.contextmanager
def dialing():
    """A dial in flight (no channel yet): its endpoint waits on the context too."""
    global _DIALING
    _DIALING += 1
    try:
        yield
    finally:
        _DIALING -= 1


__all__ = ["context", "dialing", "guard_exit", "opened", "release"]
