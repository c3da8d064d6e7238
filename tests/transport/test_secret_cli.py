"""`hybridkv secret FILE` (hybridkv/transport/secret_cli.py): a fresh secret every loader accepts, mode 0600,
never printed, an existing file kept unless --force, errors per hybridkv/cli.py's contract."""

from __future__ import annotations

import os
import stat
from importlib.metadata import EntryPoint

import pytest

import hybridkv.cli as cli
from hybridkv.transport import auth


@pytest.fixture
def hybridkv_main(monkeypatch):
    """`hybridkv` with this command's entry point as pyproject.toml declares it (an editable install made
    before the line was added does not list it yet)."""
    ep = EntryPoint(name="secret", value="hybridkv.transport.secret_cli:register", group=cli.ENTRY_POINT_GROUP)
    monkeypatch.setattr(cli, "entry_points", lambda group: [ep])
    monkeypatch.setattr(auth, "STRICT_SECRETS", True)
    return cli.main


def _error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("hybridkv: error: "), err
    return lines[0]


def test_it_writes_32_random_bytes_as_hex_mode_0600_and_never_prints_them(hybridkv_main, tmp_path, capsys):
    path = tmp_path / "hkv.secret"
    old = os.umask(0)  # the mode is set, not left to the umask
    try:
        assert hybridkv_main(["secret", str(path)]) == 0
    finally:
        os.umask(old)
    out, err = capsys.readouterr()
    text = path.read_bytes()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(text) == 65 and text.endswith(b"\n") and len(set(bytes.fromhex(text[:-1].decode()))) >= 16
    assert str(path) in out and text[:-1].decode() not in out + err
    assert auth.load_secret(file=path) == text[:-1]  # every loader takes it, strict rules on
    other = tmp_path / "other.secret"
    assert hybridkv_main(["secret", str(other)]) == 0
    assert other.read_bytes() != text  # fresh each time


def test_an_existing_file_is_kept_unless_forced(hybridkv_main, tmp_path, capsys):
    path = tmp_path / "hkv.secret"
    path.write_bytes(b"the old one\n")
    path.chmod(0o644)
    assert hybridkv_main(["secret", str(path)]) == cli.EXIT_USAGE
    assert f"'{path}' exists; expected a new path, or --force to replace it" in _error_line(capsys.readouterr().err)
    assert path.read_bytes() == b"the old one\n"
    assert hybridkv_main(["secret", str(path), "--force"]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and auth.load_secret(file=path) != b"the old one"
    assert [p.name for p in tmp_path.iterdir()] == ["hkv.secret"]  # no temporary file left behind


def test_a_path_it_cannot_use_is_one_error_line(hybridkv_main, tmp_path, capsys):
    assert hybridkv_main(["secret", str(tmp_path / "nope" / "s")]) == cli.EXIT_USAGE
    assert "folder" in _error_line(capsys.readouterr().err)
    assert hybridkv_main(["secret", str(tmp_path)]) == cli.EXIT_USAGE
    assert "is a folder; expected a file path" in _error_line(capsys.readouterr().err)
    if os.geteuid() == 0:
        return  # root writes into a read-only folder: no file-system refusal to show
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        assert hybridkv_main(["secret", str(locked / "s")]) == cli.EXIT_FAILED
        assert "cannot write the secret to" in _error_line(capsys.readouterr().err)
    finally:
        locked.chmod(0o700)


def test_the_command_is_declared_in_pyproject():
    import tomllib
    from pathlib import Path

    data = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert data["project"]["entry-points"]["hybridkv.commands"]["secret"] == "hybridkv.transport.secret_cli:register"
