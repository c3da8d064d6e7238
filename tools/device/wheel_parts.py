"""Carry a wheel set larger than one device call allows (64 MiB of working tree) in parts, one folder per call.

`pack SRC_DIR PREFIX --part-mib N` writes one xz stream (preset 9e) of a tar of SRC_DIR's wheels and cuts it into
parts of at most N MiB, in the folders PREFIX1/, PREFIX2/, ...: each holds its part and the same MANIFEST.json (the
part count, the sha256 of the whole stream and of each part, the wheels' names). Wheels stored rather than deflated
(trim_fi_wheels.py writes them so) compress about a third smaller this way than deflated one by one, which is what
lets FlashInfer's set (nvidia-cutlass-dsl's 193 MB compiler library among it) travel in two calls instead of three.

`check DIR...` says which parts of the manifest are there (the first call of a run, whose folders stay on the warm
machine for the next); `unpack DIR... --to OUT` checks that every part is there and that the stream's sha256 is the
manifest's, then extracts the wheels into OUT. Python's lzma and tarfile do both ends: no xz binary is assumed on the
device. Usage: python3 tools/device/wheel_parts.py {pack,check,unpack} ... (flashinfer_wheels.sh and gdn.sh)
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import sys
import tarfile
from dataclasses import asdict, dataclass

MANIFEST = "MANIFEST.json"
PRESET = 9 | lzma.PRESET_EXTREME
CHUNK = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Manifest:
    parts: int
    sha256: str
    part_sha256: tuple[str, ...]
    wheels: tuple[str, ...]

    def part_name(self, index: int) -> str:
        return f"part-{index + 1}-of-{self.parts}.tar.xz"


class _Cutter(io.RawIOBase):
    """A write-only file that cuts what it is given into pieces of at most `limit` bytes, in memory."""

    def __init__(self, limit: int) -> None:
        self.limit, self.pieces = limit, [bytearray()]

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data)
        while view:
            room = self.limit - len(self.pieces[-1])
            if room == 0:
                self.pieces.append(bytearray())
                continue
            self.pieces[-1] += view[:room]
            view = view[room:]
        return len(data)


def pack(src: str, prefix: str, part_mib: float) -> Manifest:
    if part_mib <= 0:
        raise ValueError(f"--part-mib must be > 0, got {part_mib}")
    wheels = sorted(f for f in os.listdir(src) if f.endswith(".whl"))
    if not wheels:
        raise ValueError(f"no wheels in {src}")
    cutter = _Cutter(int(part_mib * 2**20))
    with lzma.open(cutter, "wb", preset=PRESET) as xz, tarfile.open(fileobj=xz, mode="w|") as tar:
        for name in wheels:
            tar.add(os.path.join(src, name), arcname=name)
    pieces = [bytes(p) for p in cutter.pieces if p]
    whole = hashlib.sha256(b"".join(pieces)).hexdigest()
    manifest = Manifest(parts=len(pieces), sha256=whole, wheels=tuple(wheels),
                        part_sha256=tuple(hashlib.sha256(p).hexdigest() for p in pieces))
    for i, piece in enumerate(pieces):
        folder = f"{prefix}{i + 1}"
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, manifest.part_name(i)), "wb") as f:
            f.write(piece)
        with open(os.path.join(folder, MANIFEST), "w") as f:
            json.dump(asdict(manifest), f, indent=1)
        print(f"{folder}: {manifest.part_name(i)}, {len(piece) / 2**20:.1f} MiB")
    return manifest


def _manifest(dirs: list[str]) -> Manifest:
    found = [os.path.join(d, MANIFEST) for d in dirs if os.path.isfile(os.path.join(d, MANIFEST))]
    if not found:
        raise ValueError(f"no {MANIFEST} in {dirs}")
    raw = [json.load(open(path)) for path in found]
    if any(r != raw[0] for r in raw):
        raise ValueError(f"the folders {dirs} hold parts of different packs (their {MANIFEST} differ)")
    return Manifest(parts=raw[0]["parts"], sha256=raw[0]["sha256"], part_sha256=tuple(raw[0]["part_sha256"]),
                    wheels=tuple(raw[0]["wheels"]))


def _parts(dirs: list[str], manifest: Manifest) -> list[str | None]:
    """The path of each part of the manifest, None where none of the folders has it."""
    out: list[str | None] = []
    for i in range(manifest.parts):
        hits = [os.path.join(d, manifest.part_name(i)) for d in dirs
                if os.path.isfile(os.path.join(d, manifest.part_name(i)))]
        out.append(hits[0] if hits else None)
    return out


def check(dirs: list[str]) -> list[int]:
    """The 1-based numbers of the parts that are missing (each part present is checked against its sha256)."""
    manifest = _manifest(dirs)
    missing = []
    for i, path in enumerate(_parts(dirs, manifest)):
        if path is None:
            missing.append(i + 1)
            continue
        with open(path, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != manifest.part_sha256[i]:
                raise ValueError(f"{path} is not the part the manifest names (sha256 differs)")
        print(f"{manifest.part_name(i)}: here ({path}, {os.path.getsize(path) / 2**20:.1f} MiB)")
    for n in missing:
        print(f"{manifest.part_name(n - 1)}: not here")
    return missing


class _Joined(io.RawIOBase):
    """The parts read one after the other as one stream."""

    def __init__(self, paths: list[str]) -> None:
        self.paths, self.current = list(paths), None

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while True:
            if self.current is None:
                if not self.paths:
                    return 0
                self.current = open(self.paths.pop(0), "rb")
            n = self.current.readinto(buf)
            if n:
                return n
            self.current.close()
            self.current = None


def unpack(dirs: list[str], out: str) -> list[str]:
    manifest = _manifest(dirs)
    paths = _parts(dirs, manifest)
    missing = [i + 1 for i, p in enumerate(paths) if p is None]
    if missing:
        raise ValueError(f"parts {missing} of {manifest.parts} are not in {dirs}: each earlier call of the run must "
                         f"have landed its folder on this machine, still warm")
    digest = hashlib.sha256()
    with io.BufferedReader(_Joined(paths)) as stream:
        for block in iter(lambda: stream.read(CHUNK), b""):
            digest.update(block)
    if digest.hexdigest() != manifest.sha256:
        raise ValueError(f"the joined parts' sha256 {digest.hexdigest()} is not the manifest's {manifest.sha256}")
    os.makedirs(out, exist_ok=True)
    with lzma.open(io.BufferedReader(_Joined(paths))) as xz, tarfile.open(fileobj=xz, mode="r|") as tar:
        for member in tar:
            if not member.isfile() or member.name not in manifest.wheels:
                raise ValueError(f"unexpected member {member.name!r} in the pack")
            tar.extract(member, out, set_attrs=False, filter="data")
    return [os.path.join(out, name) for name in manifest.wheels]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack")
    p.add_argument("src")
    p.add_argument("prefix")
    p.add_argument("--part-mib", type=float, required=True)
    c = sub.add_parser("check")
    c.add_argument("dirs", nargs="+")
    u = sub.add_parser("unpack")
    u.add_argument("dirs", nargs="+")
    u.add_argument("--to", required=True)
    a = parser.parse_args(argv)
    if a.verb == "pack":
        pack(a.src, a.prefix, a.part_mib)
        return 0
    if a.verb == "check":
        return 0 if not check(a.dirs) else 3
    for path in unpack(a.dirs, a.to):
        print(f"{os.path.basename(path)}: {os.path.getsize(path) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
