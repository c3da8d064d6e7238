"""Every attack class of issue 26 against a real producer (loopback, small scale), then a legitimate
consumer: the producer survives, leaks no fd, and the consumer gets every request byte for byte while the
producer frees every block. What it costs in memory: within +100 MB of its RSS for every attack but the flood
under made-up tags, which runs against a producer of its own: UCX keeps what arrives before the producer cuts
the flooders off (and its pools do not shrink), so that flood costs about what got in before the cut-off.
``python -m tests.transport.attacks`` prints the same attacks at a larger scale, with numbers."""

from __future__ import annotations

import pytest

from tests.transport.attacks import ATTACKS, run
from tests.transport.harness import consumer, producer

pytestmark = pytest.mark.slow

REFUSED = "Refuse('refused', differences=0)"  # all an unauthenticated peer is told


TAG_FLOOD = "unknown_tags"


def _legit_consumer_served(r) -> None:
    fds = r["fds"]
    assert fds["after"] <= fds["before"], fds  # no leak (the sample before may catch a transient fd of UCX's)
    assert set(r["legit"].values()) == {"READY"} and r["byte_exact"], r["legit"]
    assert set(r["producer"].values()) == {"DONE"}
    assert r["producer_free"] and r["producer_in_flight"] == 0 and r["producer_requests"] == 0
    assert r["consumer_in_flight"] == 0
    assert r["producer_wants_ahead"] == 0  # nothing of a peer gone stays in its tables


def test_every_attack_class_costs_the_attacker_not_the_producer():
    r = run([a for a in ATTACKS if a != TAG_FLOOD])
    a, stats = r["attacks"], r["stats"]
    # Unauthenticated: no metadata, no compatibility values, one word.
    no_secret, wrong_secret = a["no_secret"]["said"]
    assert no_secret.startswith("HandshakeRefused") and no_secret.endswith(": refused"), no_secret
    assert wrong_secret.startswith("HandshakeRefused") and wrong_secret.endswith(": refused"), wrong_secret
    # The producer's Auth carries no metadata and no proof: nothing to guess the secret from offline.
    assert a["forged_hello"]["said"] == [REFUSED, "Auth(proof=0)", REFUSED]
    # A relay a legitimate decode dialled, forwarding the handshake as is or with the dialled address
    # rewritten: it gets neither side's NIXL metadata, so it reads nothing and writes nothing.
    for mode in ("forwarded", "rewritten"):
        relay = a["relay"][mode]
        assert not relay["producer_metadata"] and not relay["decode_metadata"], (mode, relay)
        assert relay["read_byte_exact"] is None and relay["write_landed"] is None, (mode, relay)
        assert relay["decode_said"].startswith("HandshakeRefused"), (mode, relay)
    assert "not this producer" in a["relay"]["forwarded"]["decode_said"]
    assert a["big_frames"]["said"] == [REFUSED]
    assert stats["unauthenticated"] >= 4 + a["big_frames"]["connections"]
    # Raw TCP connections that never became a channel were ended by the producer while held open.
    raw = a["raw_tcp"]
    assert raw["ended_by_producer"] == raw["connections"] > 0 and stats["swept"] >= raw["connections"], raw
    # Raw connections that sent more than a UCX connection request and closed (CLOSE-WAIT on the producer's
    # side, where UCX spun on them for good) are ended within a sweep (0.375 s here): fds back to before.
    cw = a["close_wait"]
    assert cw["connections"] > 0 and cw["fds_back_after_s"] is not None and cw["fds_back_after_s"] < 5.0, cw
    assert stats["swept"] >= raw["connections"] + cw["connections"] // 2, stats
    # 80 handshakes that send their Auth and fall silent, re-opened when cut, from the consumers' own address
    # (loopback): past the bounds a newcomer waits its turn instead of being turned away, so each of six
    # consumers meanwhile gets in (before: 0-4 of 6, turned away whenever no slot had gone stale).
    ho = a["half_open"]
    assert ho["connected"] == 6, ho["consumers"]
    assert ho["opened"] > ho["half_open"] and stats["cut_off"] > 0, (ho, stats)  # cut and re-opened
    # An insider without the request's token: renewals say "gone" for a live id and an unknown one
    # alike, and nothing else is answered (no claim, no refusal naming anyone).
    assert a["claim"]["leases"] == {"r-legit": 0.0, "never-existed": 0.0}, a["claim"]
    assert set(a["claim"]["replies"]) == {"Lease"}
    assert stats["forbidden"] >= 3
    # Floods: the flooding peer is cut off (Wants) or its excess renewals dropped (Heartbeats).
    assert a["heartbeat_flood"]["heartbeats"] > 0 and stats["rejected"] > 0
    assert a["want_flood"]["ended_with"] == "PeerLost"
    assert stats["cut_off"] >= 2  # the Want flooders
    # Frames still arriving from a peer cut off go with it (35 of its Wants stayed for good before).
    assert a["cut_off_backlog"]["ended_with"] == "PeerLost", a["cut_off_backlog"]
    # A completion notification sent under another session's agent name, untagged or with a guessed tag,
    # ends nothing: the claim is renewed afterwards (before, the producer ended it and freed the pages).
    forged = a["forged_notif"]
    assert forged["claimed"] == "Export" and forged["claim_ended_by_forger"] is False, forged
    assert forged["lease_after_forged_notif"] > 0 and stats["forbidden"] >= 3 + 2
    # An insider that saw a token claims nothing with it on its own session when the capability was issued for
    # another decode (auth.Claimants); that decode then claims it (before: the insider got the Export and
    # the decode was refused, CLAIMED).
    first = a["claim_first"]
    assert first["insider_got"] == [] and first["decode_got"] == ["Export"], first
    assert stats["forbidden"] >= 3 + 2 + 1
    # What it cost the producer (about 5 MB on a quiet machine), and what the legitimate consumer got.
    rss = r["rss_mb"]
    assert rss["peak"] - rss["before"] < 100, rss
    _legit_consumer_served(r)


def test_a_flood_under_made_up_tags_costs_what_got_in_before_its_cut_off():
    """Unproven connections flooding 4 KB messages under tags nobody receives, as fast as UCX takes them: the
    producer drains them and closes every flooding connection. Until then UCX queues what arrives (a receive
    buffer per message) and keeps its pools at their peak: 8 connections on loopback got ~50 MB in before their
    cut-off (0.3-0.9 s), and the producer's RSS grew by 1-2x that. Run after other attacks against the same
    producer, about as much got in but the growth reached 100-135 MB (why was not found: UCX held more of it at
    once), which is why this flood runs against a producer of its own."""
    r = run([TAG_FLOOD])
    a, stats, rss = r["attacks"][TAG_FLOOD], r["stats"], r["rss_mb"]
    assert a["sent_mb"] > 0 and stats["drained"] > 0  # drained, not kept
    assert stats["cut_off"] >= a["connections"]  # every flooder
    assert rss["peak"] - rss["before"] < 30 + 2 * a["sent_mb"], (rss, a)
    _legit_consumer_served(r)


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
