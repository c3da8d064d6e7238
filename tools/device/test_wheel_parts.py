"""CPU: tools/device/wheel_parts.py, which carries the FlashInfer wheel set to the device in parts, one call's
folder each: the parts join back to the same wheels, and a missing or altered part is named before anything is
extracted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.device import wheel_parts


@pytest.fixture
def packed(tmp_path, monkeypatch):
    monkeypatch.setattr(wheel_parts, "PRESET", 1)  # preset 9e's 674 MiB compressor is for the real set, not a test
    src = tmp_path / "src"
    src.mkdir()
    wheels = {"a-1.0-py3-none-any.whl": os.urandom(300_000), "b-2.0-py3-none-any.whl": b"x" * 50_000}
    for name, data in wheels.items():
        (src / name).write_bytes(data)
    (src / "notes.txt").write_text("not a wheel")
    manifest = wheel_parts.pack(str(src), str(tmp_path / ".whl-t"), 0.1)  # 100 KiB parts
    return tmp_path, wheels, manifest


def test_parts_join_back_to_the_same_wheels(packed):
    tmp_path, wheels, manifest = packed
    dirs = sorted(str(p) for p in tmp_path.glob(".whl-t*"))
    assert manifest.parts == len(dirs) == 3 and manifest.wheels == tuple(sorted(wheels))
    assert all(os.path.getsize(os.path.join(d, manifest.part_name(i))) <= 0.1 * 2**20 for i, d in enumerate(dirs))
    assert wheel_parts.check(dirs) == []
    out = wheel_parts.unpack(dirs, str(tmp_path / "out"))
    assert {Path(p).name: Path(p).read_bytes() for p in out} == wheels


def test_a_missing_or_altered_part_is_named_before_anything_is_extracted(packed, capsys):
    tmp_path, _, manifest = packed
    first, second, third = sorted(str(p) for p in tmp_path.glob(".whl-t*"))
    # The first call of a run: only its own folder is there yet.
    assert wheel_parts.check([first]) == [2, 3]
    assert "part-2-of-3.tar.xz: not here" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"^parts \[2\] of 3 are not in .*: each earlier call of the run must have "
                                         r"landed its folder on this machine, still warm$"):
        wheel_parts.unpack([first, third], str(tmp_path / "out"))
    path = Path(second) / manifest.part_name(1)
    path.write_bytes(path.read_bytes()[:-1] + b"?")
    with pytest.raises(ValueError, match="is not the part the manifest names"):
        wheel_parts.check([first, second, third])
    with pytest.raises(ValueError, match="the joined parts' sha256 .* is not the manifest's"):
        wheel_parts.unpack([first, second, third], str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_pack_refuses_a_bad_part_size_and_an_empty_folder(tmp_path):
    with pytest.raises(ValueError, match="--part-mib must be > 0, got 0"):
        wheel_parts.pack(str(tmp_path), str(tmp_path / "p"), 0)
    with pytest.raises(ValueError, match="no wheels in"):
        wheel_parts.pack(str(tmp_path), str(tmp_path / "p"), 1)
