"""A worker's shutdown is bounded and never raises, even when its transport never finishes closing."""

from __future__ import annotations

import asyncio
import time

from tests.vllm import harness as h


class NeverClosingConsumer:
    """Fake (a peer that never answers the close cannot be caused on one host): close() never returns."""

    async def close(self) -> None:
        await asyncio.Event().wait()


def test_shutdown_is_bounded_and_never_raises(monkeypatch):
    from hybridkv.connectors.vllm import worker_half

    monkeypatch.setattr(worker_half, "SHUTDOWN_S", 1.0)
    vc = h.make_vllm_config(role="kv_consumer")
    conn, _ = h.make_worker(vc, h.make_kv_cache_config(vc))
    real = conn.worker._consumer
    conn.worker._consumer = NeverClosingConsumer()
    t0 = time.monotonic()
    conn.shutdown()  # no exception
    assert time.monotonic() - t0 < 3.0
    if real is not None:
        asyncio.run(real.close())
