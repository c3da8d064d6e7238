"""Repack the FlashQLA wheels (flash-qla, tilelang, z3-solver, ...) without files nothing loads, to fit the device
call's 64 MiB working tree beside fla-core and the repository.

Dropped: z3-solver's `z3` executable (22 MB, tilelang uses the library only), its `libz3.so` (a byte-identical copy of
`libz3.so.4.15`, which libtvm_compiler.so NEEDs; benchmarks/device/gdn.sh links `libz3.so` to it after installing,
for the z3 Python module) and its C headers; tilelang's and TVM's C++ sources (`*.cc`, compiled into the shipped
libraries; the headers TileLang's JIT includes stay). Every other wheel is copied unchanged. RECORD keeps the original
hashes of the kept files. Usage: python3 benchmarks/device/trim_qla_wheels.py SRC_DIR DST_DIR
(benchmarks/device/flashqla_wheels.sh runs it)
"""
import fnmatch, os, shutil, sys, zipfile

SRC, DST = sys.argv[1], sys.argv[2]

DROP = {  # wheel name prefix -> globs of files to leave out
    "z3_solver-": ["*.data/data/bin/z3", "z3/lib/libz3.so", "z3/include/*"],
    "tilelang-": ["tilelang/src/*.cc", "tilelang/3rdparty/tvm/src/*.cc"],
}

os.makedirs(DST, exist_ok=True)
for whl in sorted(os.listdir(SRC)):
    if not whl.endswith(".whl"):
        continue
    src, out = os.path.join(SRC, whl), os.path.join(DST, whl)
    globs = next((g for prefix, g in DROP.items() if whl.startswith(prefix)), None)
    if globs is None:
        shutil.copyfile(src, out)
        print(f"{whl}: copied, {os.path.getsize(out) / 2**20:.1f} MiB")
        continue
    with zipfile.ZipFile(src) as z:
        infos = z.infolist()
        keep = {i.filename for i in infos if not any(fnmatch.fnmatch(i.filename, g) for g in globs)}
        record = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
        keep.add(record)
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
    print(f"{whl}: {len(infos)} -> {len(keep)} files, {os.path.getsize(src) / 2**20:.1f} -> "
          f"{os.path.getsize(out) / 2**20:.1f} MiB")
