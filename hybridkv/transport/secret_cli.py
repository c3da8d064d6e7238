"""`hybridkv secret`: write a fresh shared secret (32 random bytes as hex) to a new file of mode 0600.

Every prefill and decode instance is then given the same file (vLLM ``secret_file``, SGLang
``HYBRIDKV_SGLANG_SECRET_FILE``, ``auth.load_secret(file=...)``). The secret itself is never
printed: only where it went. An existing file is kept unless ``--force`` replaces it (then every
instance needs the new one, and restarts to read it).
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from hybridkv.cli import CommandError
from hybridkv.transport import auth


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="where to write the secret (a new file, mode 0600)")
    parser.add_argument("--force", action="store_true",
                        help="replace FILE if it exists (every instance must then get the new secret)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    path = Path(args.file)
    write_secret(path, force=args.force)
    print(f"wrote a new shared secret ({auth.MIN_SECRET_BYTES} random bytes, hex) to {str(path)!r}, mode 0600; "
          "give every prefill and decode instance this file (vLLM secret_file, SGLang "
          "HYBRIDKV_SGLANG_SECRET_FILE)")
    return 0


def write_secret(path: Path, *, force: bool = False) -> None:
    """Write a fresh secret to ``path`` (mode 0600 whatever the umask). ValueError for a path that
    exists (without ``force``) or whose folder does not; CommandError where the file system refuses."""
    text = (secrets.token_hex(auth.MIN_SECRET_BYTES) + "\n").encode()
    if auth.secret_weakness(text[:-1]) is not None:  # random bytes pass every rule: a bug if not
        raise RuntimeError(f"a fresh secret broke a strength rule: {auth.secret_weakness(text[:-1])}")
    folder = path.parent
    if not folder.is_dir():
        raise ValueError(f"{str(path)!r}: folder {str(folder)!r} does not exist; expected a path in an existing folder")
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a folder; expected a file path")
    if (path.exists() or path.is_symlink()) and not force:
        raise ValueError(f"{str(path)!r} exists; expected a new path, or --force to replace it (every instance "
                         "must then get the new secret)")
    # With --force, written beside it under a temporary name, then renamed over it: a reader sees the
    # old secret or the whole new one. Without, created exclusively: never overwritten unasked.
    target = folder / f".{path.name}.{secrets.token_hex(4)}.tmp" if force else path
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a umask cannot add bits, but one of 0o600 would leave none
            os.write(fd, text)
            os.fsync(fd)
        finally:
            os.close(fd)
        if force:
            os.replace(target, path)
    except FileExistsError:
        raise ValueError(f"{str(path)!r} exists; expected a new path, or --force to replace it") from None
    except OSError as exc:
        if force:
            target.unlink(missing_ok=True)
        raise CommandError(f"cannot write the secret to {str(path)!r}: {exc.strerror}") from None


__all__ = ["register", "run", "write_secret"]
