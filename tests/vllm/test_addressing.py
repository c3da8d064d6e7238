"""Addressing of producer ranks (DP engines, TP ranks, nodes, incarnations), PP refused, and the
decode scheduler half's early asks and releases, against the real vLLM 0.33.0 (no NIXL here: the
multi-process runs are in test_dp_restart_lease.py)."""

from __future__ import annotations

import pytest

from tests.vllm import harness as h

GROUPS = 4


def test_listen_ports_are_unique_over_dp_engines_and_tp_ranks():
    from hybridkv.connectors.vllm.addressing import listen_port

    ports = [listen_port(5600, dp_index=d, tp_size=2, tp_rank=r) for d in range(8) for r in range(2)]
    assert ports == list(range(5600, 5616))
    with pytest.raises(ValueError, match=r"side_channel_port 65530 \+ data_parallel_index 3 x tensor_parallel_size 4"):
        listen_port(65530, dp_index=3, tp_size=4, tp_rank=0)


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
@pytest.mark.parametrize("key", ["pipeline_parallel_size", "decode_context_parallel_size"])
def test_pipeline_and_context_parallelism_are_refused_at_startup(role, key):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vc = h.make_vllm_config(role="kv_both")
    kcc = h.make_kv_cache_config(vc)
    setattr(vc.parallel_config, key, 2)
    # Decode context parallelism is refused by the layout check (it shards attention layers' tokens), which
    # runs first and names the layer; pipeline parallelism by the addressing check.
    expected = (r"decode context parallelism \(2\) shards its tokens" if key == "decode_context_parallel_size"
                else rf"does not support {key} = 2; expected 1")
    with pytest.raises(ValueError, match=expected):
        KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole[role], kv_cache_config=kcc)


def _producer_scheduler(*, tp: int = 1, dp_rank: int = 0, dp_size: int = 1):
    vc = h.make_vllm_config(role="kv_producer", tp=tp, dp_rank=dp_rank, dp_size=dp_size,
                            extra={"side_channel_port": 6100, "side_channel_host": "10.0.0.1"})
    kcc = h.make_kv_cache_config(vc)
    sched = h.make_scheduler(vc, kcc, async_scheduling=False)
    return sched, h.Driver(sched, h.StandInWorker(consumer_reads=False), async_scheduling=False)


def _prefilled_params(sched, d) -> dict:
    sched.add_request(h.make_request("p1", prompt_len=40, max_tokens=4, params={"do_remote_decode": True}))
    d.run(until=lambda: "p1" in d.finished)
    return d.finished["p1"][1]


def test_params_name_every_rank_the_workers_reported():
    """A TP 2 group spread over two nodes: each worker reports its own node, port and agent
    through vLLM's handshake path, and kv_transfer_params name each rank's."""
    from hybridkv.connectors.vllm.addressing import RankAddress
    from hybridkv.connectors.vllm.metadata import HybridKVHandshakeMetadata
    from hybridkv.connectors.vllm.params import RemotePrefill

    sched, d = _producer_scheduler(tp=2, dp_rank=1, dp_size=2)
    ranks = [RankAddress(host="10.0.0.1", port=6102, agent="hybridkv-a"),
             RankAddress(host="10.0.0.2", port=6103, agent="hybridkv-b")]
    sched.connector.set_xfer_handshake_metadata_pp_aware(
        {(0, r): HybridKVHandshakeMetadata(tp_rank=r, address=a) for r, a in enumerate(ranks)})
    params = _prefilled_params(sched, d)
    assert params["remote_ranks"] == [a.to_json() for a in ranks]
    assert (params["remote_host"], params["remote_port"], params["tp_size"]) == ("10.0.0.1", 6102, 2)
    remote = RemotePrefill.from_params(params)
    assert [remote.rank_address(r) for r in range(2)] == ranks
    with pytest.raises(ValueError, match="pp_rank > 0"):  # vLLM's own refusal: PP stages are not served
        sched.connector.set_xfer_handshake_metadata_pp_aware(
            {(1, 0): HybridKVHandshakeMetadata(tp_rank=0, address=ranks[0])})
    with pytest.raises(ValueError, match=r"missing \[1\]"):
        sched.connector.set_xfer_handshake_metadata({0: HybridKVHandshakeMetadata(tp_rank=0, address=ranks[0])})


def test_params_without_reports_name_the_configured_ports_of_this_dp_engine():
    sched, d = _producer_scheduler(tp=2, dp_rank=3, dp_size=4)
    params = _prefilled_params(sched, d)
    # DP engine 3 of TP 2: ranks listen on 6100 + 3 x 2 + r
    assert params["remote_ranks"] == [["10.0.0.1", 6106, None], ["10.0.0.1", 6107, None]]


@pytest.mark.parametrize("bad, message", [
    ([["10.0.0.1", 6100, "a"]], r"remote_ranks lists 1 rank\(s\); expected tp_size = 2"),
    ([["10.0.0.1", 0, "a"], ["h", 1, "b"]], r"remote_ranks\[0\]: rank port = 0"),
    ("10.0.0.1:6100", "expected one \\[host, port, agent\\] per producer TP rank"),
])
def test_bad_remote_ranks_are_refused_naming_the_value(bad, message):
    from hybridkv.connectors.vllm.params import RemotePrefill

    params = {**h.remote_prefill_params("r", groups=GROUPS), "tp_size": 2, "remote_ranks": bad}
    with pytest.raises(ValueError, match=message):
        RemotePrefill.from_params(params)


def test_older_params_without_ranks_read_rank_r_at_port_plus_r():
    from hybridkv.connectors.vllm.params import RemotePrefill

    remote = RemotePrefill.from_params({**h.remote_prefill_params("r", groups=GROUPS), "tp_size": 2})
    assert [(a.host, a.port, a.agent) for a in map(remote.rank_address, range(2))] == [
        ("127.0.0.1", 5600, None), ("127.0.0.1", 5601, None)]


class _Recording(h.StandInWorker):
    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []
        self.released: list[str] = []

    def execute(self, so):
        self.asked += list(so.kv_connector_metadata.heartbeats)
        self.released += list(so.kv_connector_metadata.releases)
        return super().execute(so)


def test_decode_asks_from_arrival_and_releases_what_it_will_not_read():
    """Queued requests are handed to the worker at once (it asks the producer and renews the
    lease while they wait); one aborted while queued is released to the producer; a loaded one
    is not."""
    from vllm.v1.request import RequestStatus

    vc = h.make_vllm_config(role="kv_consumer", max_num_seqs=1)
    kcc = h.make_kv_cache_config(vc)
    sched = h.make_scheduler(vc, kcc, async_scheduling=False)
    worker = _Recording()
    d = h.Driver(sched, worker, async_scheduling=False)
    sched.add_request(h.make_request("busy", prompt_len=32, max_tokens=40))  # takes the only running slot
    d.step()
    for rid in ("r1", "r2"):
        sched.add_request(h.make_request(rid, prompt_len=100, max_tokens=2,
                                         params=h.remote_prefill_params(rid, groups=GROUPS)))
    d.step()
    assert worker.asked == ["r1", "r2"] and not worker.orders  # asked for while still queued
    sched.finish_requests(["r2"], RequestStatus.FINISHED_ABORTED)
    sched.add_request(h.make_request("r3", prompt_len=100, max_tokens=2,
                                     params=h.remote_prefill_params("r3", groups=GROUPS)))
    sched.finish_requests(["r3"], RequestStatus.FINISHED_ABORTED)  # aborted before any step saw it
    sched.finish_requests(["busy"], RequestStatus.FINISHED_ABORTED)
    d.run()
    assert worker.released == ["r2", "r3"]  # told to the producer; r1 was loaded
    assert worker.asked == ["r1", "r2"]
    assert [rid for _, rid in worker.orders] == ["r1"]
    d.drain()
    assert h.free_blocks(sched) == kcc.num_blocks - 1 and sched.connector.scheduler.idle()
