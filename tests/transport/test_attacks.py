"""Every attack class of issue 26 against one real producer (loopback, small scale), then a
legitimate consumer: the producer survives, stays within +100 MB of its RSS, leaks no fd, and the
consumer gets every request byte for byte while the producer frees every block.
``python -m tests.transport.attacks`` prints the same attacks at a larger scale, with numbers."""

from __future__ import annotations

import pytest

from tests.transport.attacks import ATTACKS, run
from tests.transport.harness import consumer, producer

pytestmark = pytest.mark.slow

REFUSED = "Refuse('refused', differences=0)"  # all an unauthenticated peer is told


def test_every_attack_class_costs_the_attacker_not_the_producer():
    r = run(ATTACKS)
    a, stats = r["attacks"], r["stats"]
    # Unauthenticated: no metadata, no compatibility values, one word.
    no_secret, wrong_secret = a["no_secret"]["said"]
    assert no_secret.startswith("HandshakeRefused") and no_secret.endswith(": refused"), no_secret
    assert "did not prove the shared secret" in wrong_secret, wrong_secret  # the consumer checks the producer too
    assert a["forged_hello"]["said"] == [REFUSED, "Auth", REFUSED]  # the producer's Auth carries no metadata
    assert a["big_frames"]["said"] == [REFUSED]
    assert stats["unauthenticated"] >= 3 + a["big_frames"]["connections"]
    # Raw TCP connections that never became a channel were ended by the producer while held open.
    raw = a["raw_tcp"]
    assert raw["ended_by_producer"] == raw["connections"] > 0 and stats["swept"] >= raw["connections"], raw
    # Messages under tags nobody receives were drained, not kept.
    assert a["unknown_tags"]["sent_mb"] > 0 and stats["drained"] > 0
    # An insider without the request's token: renewals say "gone" for a live id and an unknown one
    # alike, and nothing else is answered (no claim, no refusal naming anyone).
    assert a["claim"]["leases"] == {"r-legit": 0.0, "never-existed": 0.0}, a["claim"]
    assert set(a["claim"]["replies"]) == {"Lease"}
    assert stats["forbidden"] >= 3
    # Floods: the flooding peer is cut off (Wants) or its excess renewals dropped (Heartbeats).
    assert a["heartbeat_flood"]["heartbeats"] > 0 and stats["rejected"] > 0
    assert a["want_flood"]["ended_with"] == "PeerLost"
    assert stats["cut_off"] >= 1 + a["unknown_tags"]["connections"]  # the Want flooder, every tag flooder
    # What it cost the producer, and what the legitimate consumer got.
    rss, fds = r["rss_mb"], r["fds"]
    assert rss["peak"] - rss["before"] < 100, rss
    assert fds["after"] == fds["before"], fds
    assert set(r["legit"].values()) == {"READY"} and r["byte_exact"], r["legit"]
    assert set(r["producer"].values()) == {"DONE"}
    assert r["producer_free"] and r["producer_in_flight"] == 0 and r["producer_requests"] == 0
    assert r["consumer_in_flight"] == 0


def test_unauthenticated_mode_refuses_without_saying_what_differs():
    """A lab without a secret still serves compatible peers, but an incompatible one learns only
    "refused": its differences would be enough to forge a Hello that passes."""
    prod = producer(secret=None)
    try:
        host, port, _ = prod.expect("addr")
        cons = consumer((host, port), secret=None,
                        attempts=[{"name": "geometry", "geo": {"num_layers": 8}}, {"name": "compatible"}])
        name, fields, text = cons.expect("refused")
        assert name == "geometry" and fields == [] and text.endswith(": refused"), text
        assert cons.expect("connected") == "compatible"
        cons.expect("finished")
        prod.send("stop")
        assert prod.expect("stats")["refused"] == 1
    finally:
        prod.stop()
