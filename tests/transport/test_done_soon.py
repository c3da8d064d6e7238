"""Done of a landed import goes out in the background, in the channel's order, and a closing consumer flushes it.

In process, no NIXL: the control channel is a fake whose sends can be held (named so: a control link that
stalls a send is not a fault the real one can be made to show on demand).
"""

from __future__ import annotations

import asyncio
import types

from hybridkv import wire
from hybridkv.transport.import_ends import Endings


class HeldChannelFake:
    """Records what is sent; a send waits while ``hold`` is clear."""

    def __init__(self) -> None:
        self.sent: list[wire.Message] = []
        self.hold = asyncio.Event()

    async def send(self, msg: wire.Message) -> None:
        await self.hold.wait()
        self.sent.append(msg)


def _importer() -> Endings:
    imp = Endings.__new__(Endings)  # only the Done path: no side, no data plane
    imp._sending = set()
    return imp


def _work(channel, rid: str):
    part = types.SimpleNamespace(rid=rid, token=b"t" * 16, peer=types.SimpleNamespace(channel=channel))
    return types.SimpleNamespace(part=part)


def test_done_is_sent_in_the_background_and_flushed_before_close():
    async def run():
        ch, imp = HeldChannelFake(), _importer()
        imp.end_parts_soon([_work(ch, "a")], True)  # returns at once although the send is held
        imp.end_parts_soon([_work(ch, "b")], True)
        assert not ch.sent and len(imp._sending) == 2
        ch.hold.set()
        await imp.flush(5.0)
        assert [(m.request_id, m.ok) for m in ch.sent] == [("a", True), ("b", True)]  # in the order ended
        assert not imp._sending

    asyncio.run(run())


def test_a_done_stuck_past_the_bound_is_cancelled_at_close():
    async def run():
        ch, imp = HeldChannelFake(), _importer()
        imp.end_parts_soon([_work(ch, "a")], True)
        await imp.flush(0.05)  # the producer's lease frees its blocks; closing does not hang on it
        assert not ch.sent and not imp._sending

    asyncio.run(run())
