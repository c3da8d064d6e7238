"""`hybridkv bench transfer --posting-curve`: its inputs, and the lists it posts (no processes here; the
end-to-end run is in test_bench.py)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.benchmarks.transfer.posting import MAX_CURVE, _span_rows, gapped_rows, parse_curve
from hybridkv.cli import main


def test_curve_counts_are_parsed_and_bounded():
    assert parse_curve(None) == () and parse_curve("1,64,1024") == (1, 64, 1024)
    for bad in ("0", "64,1", "1,1", "x", f"{MAX_CURVE + 1}"):
        with pytest.raises(ValueError, match="--posting-curve"):
            parse_curve(bad)


@pytest.mark.parametrize("text", ["0,4", "8,2", "lots"])
def test_bad_curve_is_one_usage_line_before_any_process(capsys, text):
    assert main(["bench", "transfer", "--posting-curve", text]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridkv: error: --posting-curve") and "Traceback" not in err, err


def test_touching_pieces_tile_the_span_and_apart_pieces_never_touch():
    touching = _span_rows(4096, 1000, 0, 7)
    assert touching[0, 0] == 4096 and int(touching[:, 1].sum()) == 1000
    assert all(touching[i, 0] + touching[i, 1] == touching[i + 1, 0] for i in range(6))
    apart = gapped_rows(4096, 1 << 20, 3, 1000, 64)
    assert len(apart) == 1000 and set(apart[:, 1]) == {64} and set(apart[:, 2]) == {3}
    ends = apart[:-1, 0] + apart[:-1, 1]
    assert np.all(ends < apart[1:, 0])  # a gap after every piece: nothing to merge
    assert int(apart[-1, 0] + 64) <= 4096 + (1 << 20)
    with pytest.raises(ValueError, match="do not fit apart"):
        gapped_rows(0, 1000, 0, 100, 64)
