"""Repack the FlashQLA wheels (flash-qla, tilelang, z3-solver, ...) without files nothing loads, to fit the device
call's 64 MiB working tree beside fla-core and the repository.

Dropped: z3-solver's `z3` executable (22 MB, tilelang uses the library only), its `libz3.so` (a byte-identical copy of
`libz3.so.4.15`, which libtvm_compiler.so NEEDs; tools/device/gdn.sh links `libz3.so` to it after installing,
for the z3 Python module) and its C headers; tilelang's and TVM's C++ sources (`*.cc`, compiled into the shipped
libraries; the headers TileLang's JIT includes stay). Every other wheel is copied unchanged. RECORD keeps the original
hashes of the kept files. Usage: python3 tools/device/trim_qla_wheels.py SRC_DIR DST_DIR
(tools/device/flashqla_wheels.sh runs it)
"""
import sys

from wheel_repack import trim_dir

DROP = {  # wheel name prefix -> globs of files to leave out
    "z3_solver-": ["*.data/data/bin/z3", "z3/lib/libz3.so", "z3/include/*"],
    "tilelang-": ["tilelang/src/*.cc", "tilelang/3rdparty/tvm/src/*.cc"],
}

if __name__ == "__main__":
    trim_dir(sys.argv[1], sys.argv[2], DROP)
