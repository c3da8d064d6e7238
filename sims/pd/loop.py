"""The parts of the simulator that know nothing of requests: the event clock, the step loop of an
engine (sync or async scheduling) and a link shared by the transfers in flight."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from .params import Scheduling

Event = Callable[[float], None]


class Clock:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Event]] = []
        self._seq = 0
        self.now = 0.0

    def at(self, t: float, event: Event) -> None:
        if t < self.now:
            raise RuntimeError(f"event scheduled in the past: {t} < {self.now}")
        # seq breaks ties in scheduling order: a step's completion, scheduled when the
        # step was formed, runs before a later formation at the same instant.
        heapq.heappush(self._heap, (t, self._seq, event))
        self._seq += 1

    def run(self, stop: Callable[[], bool]) -> None:
        while self._heap and not stop():
            t, _, event = heapq.heappop(self._heap)
            self.now = t
            event(t)


class Stepper:
    """A step loop: form a batch, spend CPU time, then device time.

    SYNC forms the next step when this one's output is processed. ASYNC forms it as soon
    as this step is on the device, so at most one step is prepared ahead (one step of
    overlap); the next device phase starts when both its CPU work and this step are done.
    """

    def __init__(self, clock: Clock, scheduling: Scheduling) -> None:
        self.clock = clock
        self.scheduling = scheduling
        self.device_free_at = 0.0
        self.active = False

    def wake(self, t: float) -> None:
        if not self.active:
            self.active = True
            self.clock.at(t, self._form)

    def _form(self, t: float) -> None:
        batch = self.take_batch(t)
        if batch is None:
            self.active = False
            self.on_idle(t)
            return
        cpu, device = self.cost(batch)
        start = max(t + cpu, self.device_free_at)
        end = start + device
        self.device_free_at = end
        if self.scheduling is Scheduling.ASYNC:
            self.clock.at(end, lambda now: self.finish(batch, now))
            self.clock.at(start, self._form)
        else:
            def done(now: float) -> None:
                self.finish(batch, now)
                self._form(now)
            self.clock.at(end, done)

    def take_batch(self, t: float):  # pragma: no cover - abstract
        raise NotImplementedError

    def cost(self, batch) -> tuple[float, float]:  # pragma: no cover - abstract
        raise NotImplementedError

    def finish(self, batch, t: float) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def on_idle(self, t: float) -> None:
        pass



class Link:
    """One node's link, shared by processor sharing among the transfers in flight: n of them each
    progress at 1/n of the link. `work_s` is a transfer's link-seconds at full rate; `on_done(item, t)`
    is called `latency_s` after its work is done."""

    def __init__(self, clock: Clock, latency_s: float, on_done: Callable[[Any, float], None]) -> None:
        self.clock = clock
        self.latency_s = latency_s
        self.on_done = on_done
        self.left: dict[Any, float] = {}  # link-seconds of work still to do, at full rate
        self.last = 0.0
        self.version = 0

    def _advance(self, t: float) -> None:
        if self.left:
            done = (t - self.last) / len(self.left)
            for item in self.left:
                self.left[item] -= done
        self.last = t

    def start(self, item: Any, t: float, work_s: float) -> None:
        self._advance(t)
        self.left[item] = work_s
        self._schedule(t)

    def _schedule(self, t: float) -> None:
        self.version += 1
        if not self.left:
            return
        version = self.version
        first = min(self.left.values())
        self.clock.at(t + max(first, 0.0) * len(self.left), lambda now: self._end(now, version))

    def _end(self, t: float, version: int) -> None:
        if version != self.version:
            return  # the set changed since: a later event holds the right time
        self._advance(t)
        # Float residue: whatever is within a picosecond of done is done.
        ended = [item for item, w in self.left.items() if w <= 1e-12]
        for item in ended:
            del self.left[item]
        self._schedule(t)
        for item in ended:
            self.clock.at(t + self.latency_s, lambda now, it=item: self.on_done(it, now))
