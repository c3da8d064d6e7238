"""Write a wheel with only some of its files, for trim_wheels.py, trim_qla_wheels.py and trim_fi_wheels.py (the
device carry's 64 MiB).

RECORD is cut to the kept files and keeps their original hashes; every entry keeps its date and permissions.
"""
import fnmatch
import os
import shutil
import zipfile


def repack(z: zipfile.ZipFile, keep: set[str], out: str, *, compression: int = zipfile.ZIP_DEFLATED) -> int:
    """Write the files of ``z`` named in ``keep``, and its RECORD cut to them, to ``out``; returns how many.

    ``compression`` is ZIP_DEFLATED, or ZIP_STORED for a wheel that is then packed by one compressor across all its
    files (wheel_parts.py: xz of stored entries is a third smaller than the entries deflated one by one).
    """
    infos = z.infolist()
    record = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
    keep = keep | {record}
    rec_lines = [line for line in z.read(record).decode().splitlines() if line.split(",")[0] in keep]
    with zipfile.ZipFile(out, "w", compression, compresslevel=9) as o:
        for i in infos:
            if i.filename not in keep:
                continue
            data = "\n".join(rec_lines).encode() + b"\n" if i.filename == record else z.read(i)
            zi = zipfile.ZipInfo(i.filename, date_time=i.date_time)
            zi.external_attr = i.external_attr
            zi.compress_type = compression
            o.writestr(zi, data, compresslevel=9)
    return len(keep)


def trim_dir(src: str, dst: str, drop: dict[str, list[str]], *, compression: int | None = None) -> None:
    """Each wheel of ``src`` into ``dst``, without the files matching the globs of the first ``drop`` prefix its name
    starts with. A wheel no prefix names is copied byte for byte, unless ``compression`` asks every wheel to be
    rewritten with it."""
    os.makedirs(dst, exist_ok=True)
    for whl in sorted(os.listdir(src)):
        if not whl.endswith(".whl"):
            continue
        source, out = os.path.join(src, whl), os.path.join(dst, whl)
        globs = next((g for prefix, g in drop.items() if whl.startswith(prefix)), None)
        if globs is None and compression is None:
            shutil.copyfile(source, out)
            print(f"{whl}: copied, {os.path.getsize(out) / 2**20:.1f} MiB")
            continue
        with zipfile.ZipFile(source) as z:
            infos = z.infolist()
            names = {i.filename for i in infos if not any(fnmatch.fnmatch(i.filename, g) for g in globs or ())}
            kept = repack(z, names, out, compression=zipfile.ZIP_DEFLATED if compression is None else compression)
        print(f"{whl}: {len(infos)} -> {kept} files, {os.path.getsize(source) / 2**20:.1f} -> "
              f"{os.path.getsize(out) / 2**20:.1f} MiB")
