"""Write a wheel with only some of its files, for trim_wheels.py and trim_qla_wheels.py (the device carry's 64 MiB).

RECORD is cut to the kept files and keeps their original hashes; every entry keeps its date and permissions.
"""
import zipfile


def repack(z: zipfile.ZipFile, keep: set[str], out: str) -> int:
    """Write the files of ``z`` named in ``keep``, and its RECORD cut to them, to ``out``; returns how many."""
    infos = z.infolist()
    record = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
    keep = keep | {record}
    rec_lines = [line for line in z.read(record).decode().splitlines() if line.split(",")[0] in keep]
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as o:
        for i in infos:
            if i.filename not in keep:
                continue
            data = "\n".join(rec_lines).encode() + b"\n" if i.filename == record else z.read(i)
            zi = zipfile.ZipInfo(i.filename, date_time=i.date_time)
            zi.external_attr = i.external_attr
            zi.compress_type = zipfile.ZIP_DEFLATED
            o.writestr(zi, data, compresslevel=9)
    return len(keep)
