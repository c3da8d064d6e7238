"""CPU: the Triton chunk kernels themselves (not the reference) in Triton's interpreter, every schedule,
so CI checks the kernels' logic - the inverse, the scores, the segments of a pipelined call and the state
handed between them, both inverse methods - without a GPU. The interpreter runs programs one after another, so it checks
what the kernels compute, not how the two streams overlap (the GPU tests do that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")


def test_chunk_kernels_in_the_interpreter_match_the_reference():
    script = Path(__file__).with_name("interpreted_chunk.py")
    # The repository root on the path: the script also checks a probe's kernel from benchmarks/gdn.
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    # The script's two halves side by side: the interpreter is single-threaded and CI has two cores.
    parts = [subprocess.Popen([sys.executable, str(script), part], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for part in ("l2", "no-l2")]
    errors = {}
    for proc in parts:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        errors.update(json.loads(out.strip().splitlines()[-1]))
    assert set(errors) == {f"{n}seq/{s}/l2={l2}" for n in (3, 1)
                           for s in ("serial", "pipelined", "scores-pipelined")
                           for l2 in (True, False)} | {f"{n}seq/scores-scan/l2=True" for n in (3, 1)} | {
                               f"fp16-k64-v96/{f}" for f in ("fused", "scores", "scan")} | {
                               "decode-tma", "decode-tma/vs-tile", "decode-tma/untouched", "decode-tma/qkv-tma",
                               "decode-rows/vs-tile", "decode-prefetch/vs-tile"}
    # The TMA decode walk does the tile kernel's arithmetic in the same order: equal bit for bit, pads, the
    # other layer and unused slots untouched, pads' outputs zero.
    assert errors.pop("decode-tma/vs-tile") == 0.0
    assert errors.pop("decode-tma/untouched") == 1.0
    assert errors.pop("decode-tma/qkv-tma") == 1.0
    assert errors.pop("decode-rows/vs-tile") == 1.0
    assert errors.pop("decode-prefetch/vs-tile") == 1.0
    for name, (o_err, s_err) in errors.items():
        # bf16 inputs and GEMM operands, as on the GPU (the GPU tests' bound).
        assert o_err < 2e-2 and s_err < 2e-2, (name, o_err, s_err)


def test_decode_kernels_read_and_write_each_live_state_element_once_and_nothing_else():
    """Every shipped config of the tile, row-looped, register-prefetching and TMA decode kernels, in the interpreter
    with its loads and stores recorded (`interpreted_decode_reads.py`): each element of the live slots' state in the
    decoded layer is read once and written once, and nothing else of the pool is touched (the other layer, unused
    slots, a pad's slot 0, and past the pool's last slot). A prefetch past a program's last block leaves the outputs
    right and shows only here (the prefetching kernel with that block's mask removed: 768-3,072 elements read
    outside, 3,072-31,744 twice). The prefetching kernel's L2 prefetches (L2AHEAD) are recorded too: each asks only for
    rows its program goes on to read, each once."""
    from hybridkv.kernels.gdn import decode_prefetch as triton_decode_prefetch
    from hybridkv.kernels.gdn import decode_rows as triton_decode_rows
    from hybridkv.kernels.gdn import decode_tma as triton_decode_tma

    script = Path(__file__).with_name("interpreted_decode_reads.py")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    counts, prefetch = report["counts"], {name: tuple(c) for name, c in report["prefetch"].items()}
    assert {f"prefetch {c}" for c in triton_decode_prefetch.PREFETCH_CONFIGS} <= set(prefetch)
    names = {"tile (32, 4)", "tile (64, 8)"} | {f"rows {c}" for c in triton_decode_rows.ROWS_CONFIGS} | set(
        prefetch) | {f"tma {c}" for c in triton_decode_tma.TMA_CONFIGS}
    assert set(counts) == {f"{n}/{w}" for n in names for w in ("reads", "writes", "l2")}
    wrong = {name: c for name, c in counts.items() if not name.endswith("/l2") and c != [0, 0]}
    assert not wrong, wrong
    # L2 prefetches: each live row after a program's first two blocks asked for once, nothing else; and some asked for
    # where L2AHEAD is on and its programs have more than two blocks (the test's heads: K 32, V 64, 4 live sequences).
    l2 = {name.removesuffix("/l2"): c for name, c in counts.items() if name.endswith("/l2")}
    assert all(mismatched == 0 for mismatched, _ in l2.values()), l2
    for name, (_, asked) in l2.items():
        cfg = prefetch.get(name, ())
        rows = min(cfg[1], 64) if cfg else 0
        on = len(cfg) > 3 and rows // min(cfg[0], rows) > 2
        assert (asked > 0) == on, (name, asked)
