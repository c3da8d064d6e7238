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

from wheel_repack import repack

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
        kept = repack(z, {i.filename for i in infos if not any(fnmatch.fnmatch(i.filename, g) for g in globs)}, out)
    print(f"{whl}: {len(infos)} -> {kept} files, {os.path.getsize(src) / 2**20:.1f} -> "
          f"{os.path.getsize(out) / 2**20:.1f} MiB")
