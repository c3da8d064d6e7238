"""Two real processes over NIXL (UCX) with VRAM regions: pattern-filled pages, checksums compared.

Same GPU (both sides on cuda:0) and across GPUs (producer on cuda:0, consumer on
cuda:1: the prefill -> decode path inside one node). Also the bench's options for
the two-GPU measurement: device placement and the UCX transport summary.
"""

from __future__ import annotations

import argparse
import itertools
import json

import pytest

from hybridkv.benchmarks.transfer import command as bench
from hybridkv.benchmarks.transfer import posting as bench_posting
from hybridkv.benchmarks.transfer import sides as bench_sides
from hybridkv.transport import ucx_log
from tests.transport.harness import consumer, producer

REQUESTS = [("v-long", 300, False), ("v-short", 20, False), ("v-mid", 100, True)]


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


TWO_GPUS = pytest.mark.skipif(_gpus() < 2, reason="producer on cuda:0 and consumer on cuda:1 need "
                              "torch.cuda.device_count() >= 2 (run on nvidia-h200-x2)")


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("devices", [pytest.param((0, 0), id="same-gpu"),
                                     pytest.param((0, 1), id="cross-gpu", marks=TWO_GPUS)])
@pytest.mark.parametrize("mode", ["PULL", "PUSH"])
def test_vram_round_trip_checksums(mode, devices):
    p_dev, c_dev = devices
    prod = producer(mode=mode, requests=REQUESTS, mem="vram", device=p_dev)
    try:
        host, port, _ = prod.expect("addr")
        cons = consumer((host, port), mode=mode, requests=REQUESTS, mem="vram", device=c_dev)
        sent = prod.expect("digests")
        results = cons.expect("results")
        got = cons.expect("digests")
        assert {r[0]: r[1] for r in results} == {rid: "READY" for rid, _, _ in REQUESTS}, results
        assert got == sent  # every byte of every block landed in the consumer's GPU memory
        if mode == "PULL":  # the consumer posts the READs, so it counts the bytes
            assert all(nbytes > 0 for *_, nbytes in results), results
        # Each side's memory is on its own GPU, and NIXL was told that device.
        assert cons.expect("state")["placement"] == {"device_ids": [c_dev], "tensor_devices": [c_dev]}
        pstate = prod.expect("state")
        assert pstate["placement"] == {"device_ids": [p_dev], "tensor_devices": [p_dev]}
        assert pstate["free"] == pstate["total"] and pstate["in_flight"] == 0
        cons.expect("finished")
    finally:
        prod.stop()


def _bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.register(parser)  # the bench's options, and the planner `hybridkv bench transfer` runs with
    return parser.parse_args(list(argv))


def test_bench_devices_parse():
    assert bench_sides.parse_devices(None, "dram") == (0, 0)
    assert bench_sides.parse_devices("0,1", "vram") == (0, 1)
    assert bench_sides.parse_devices("1", "vram") == (1, 1)


@pytest.mark.parametrize("text, mem, named", [
    ("0,1", "dram", "--mem vram"),  # places VRAM only
    ("a,b", "vram", "'a,b'"),
    ("0,1,2", "vram", "'0,1,2'"),
    ("-1,0", "vram", "'-1,0'"),
    ("", "vram", "''"),
])
def test_bench_devices_refused_naming_the_value(text, mem, named):
    with pytest.raises(ValueError, match="--devices") as err:
        bench.run(_bench_args("--mem", mem, f"--devices={text}"))
    assert named in str(err.value)


def test_bench_devices_beyond_visible_gpus():
    from hybridkv.cli import CommandError

    n = _gpus()
    # Without a GPU the machine is what is missing (exit 1), with one the input names too many.
    with pytest.raises(ValueError if n else CommandError) as err:
        bench.run(_bench_args("--mem", "vram", "--devices", f"0,{n + 8}"))
    if n:
        assert f"'0,{n + 8}'" in str(err.value) and f"only {n} CUDA device" in str(err.value)
    else:
        assert "no CUDA device" in str(err.value)


def _table(pid: int, title: list[str], rows: list[tuple[str, str, str]]) -> list[str]:
    """One table as UCX_PROTO_INFO prints it (format of UCX 1.21, as seen from NIXL 1.5.1's agents)."""
    pre = f"[1795960353.872499] [vm:{pid}:0]   "
    border = pre + "+--------+-------------+------------------+"
    out = [border, *(pre + f"| {t} |" for t in title), border, pre + "| Range  | Description | Config |", border]
    out += [pre + f"| {r} | {d} | {c} |" for r, d, c in rows]
    return out + [border]


def test_transport_summary_reads_ucx_proto_tables():
    """Only NIXL's own remote reads/writes count (not its loopback 'self' ep, not ucxx's control channel);
    tables of the two processes may interleave line by line in the shared log."""
    read = _table(11, ["hybridkv-aaaa intra-node cfg#1", "remote memory read by ucp_get*(multi) into cuda/dev[1] "
                       "from cuda/dev[0]"], [("0..inf", "software emulation", "tcp/lo")])
    write = _table(22, ["hybridkv-bbbb intra-node cfg#2", "remote memory write by ucp_put* from cuda/dev[0] to "
                        "cuda/dev[1]"], [("0..8K", "zero-copy", "cuda_ipc/cuda"), ("8193..inf", "zero-copy",
                                                                                 "cuda_ipc/cuda")])
    noise = (_table(11, ["hybridkv-aaaa self cfg#0", "remote memory read by ucp_get* into host memory from host"],
                    [("0..inf", "zero-copy", "cma/memory")])
             + _table(33, ["ucp_context_0 intra-node cfg#1 | remote memory write by ucp_put* from host memory"],
                      [("0..inf", "zero-copy", "sysv/memory")]))
    mixed = [line for pair in itertools.zip_longest(read, write) for line in pair if line] + noise
    text = "\n".join(["2026-11-29 13:52:33 NIXL INFO    _api.py:281 Initialized NIXL agent: hybridkv-aaaa", *mixed])
    rep = ucx_log.summarize_transports(text)
    assert rep["tls"] == ["cuda_ipc", "tcp"]
    assert rep["cuda_ipc"] and rep["software_emulation"]
    assert rep["data_path"] == [
        "remote memory read by ucp_get*(multi) into cuda/dev[1] from cuda/dev[0]: 0..inf software emulation via tcp/lo",
        "remote memory write by ucp_put* from cuda/dev[0] to cuda/dev[1]: 0..8K zero-copy via cuda_ipc/cuda",
        "remote memory write by ucp_put* from cuda/dev[0] to cuda/dev[1]: 8193..inf zero-copy via cuda_ipc/cuda",
    ]
    assert ucx_log.summarize_transports("no tables here")["tls"] == []


@pytest.mark.slow
def test_bench_proto_log_reports_transports(tmp_path, capsys):
    """Real UCX output of both processes lands in the log and names the transport of NIXL's reads (DRAM here:
    the same capture serves --mem vram --devices 0,1 on a two-GPU machine)."""
    log = tmp_path / "ucx.log"
    assert bench.run(_bench_args("--json", "--layers", "4", "--tokens", "256", "--iters", "1",
                                 "--proto-log", str(log))) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert log.stat().st_size > 0
    t = rep["transports"]
    assert any(e.startswith("remote memory read by ucp_get") for e in t["data_path"]), t  # NIXL's READs
    assert t["tls"] and not t["cuda_ipc"], t
    assert rep["copy_GBps"] > 0 and rep["raw_posted"] == 1 and rep["devices"] is None
    assert rep["raw_vs_copy"] == pytest.approx(rep["raw_GBps"] / rep["copy_GBps"], rel=0.01)


def test_an_emulated_write_table_does_not_flag_the_read_data_path():
    """The device run's logs: UCX set up put-from-host-to-cuda by tcp emulation, but every byte moved by
    cuda_ipc READs; the summary must not call that run emulated, and must still show the write apart."""
    read = _table(11, ["hybridkv-aaaa intra-node cfg#2", "remote memory read by ucp_get*(multi) into cuda/GPU1 "
                       "from cuda/dev[2]"], [("0..inf", "zero-copy", "cuda_ipc/cuda")])
    write = _table(11, ["hybridkv-aaaa intra-node cfg#2", "remote memory write by ucp_put* from host memory to "
                        "cuda/dev[2]"], [("0..inf", "software emulation", "tcp/lo")])
    rep = ucx_log.summarize_transports("\n".join(write + read))
    assert rep["cuda_ipc"] and not rep["software_emulation"]
    assert rep["emulated_elsewhere"] == [
        "remote memory write by ucp_put* from host memory to cuda/dev[2]: 0..inf software emulation via tcp/lo"]


def test_raw_splits_parse_and_cover_the_span_exactly():
    assert bench_posting.parse_splits("8,2") == (1, 8, 2)
    assert bench_posting.parse_splits("1") == (1,)
    for bad in ("0", "x", "", "2,-1", "5000"):
        with pytest.raises(ValueError, match="--raw-splits"):
            bench_posting.parse_splits(bad)
    rows = bench_posting._span_rows(1000, 1003, 3, 4)
    assert rows[:, 1].sum() == 1003 and rows[0, 0] == 1000 and (rows[:, 2] == 3).all()
    assert all(rows[i, 0] + rows[i, 1] == rows[i + 1, 0] for i in range(3))
