"""Repack the CUDA 13 NIXL/UCX wheels without what hybridkv never loads, to fit the device carry (64 MiB).

Kept: Python code, NIXL core + the UCX backend plugin, the UCX transport modules
(cuda, cma) and the ELF closure (readelf NEEDED) of all that; UCX's/ucxx's/rmm's
shared libraries. Dropped: nixl_ep (expert-parallel extension, ~95 MB), the other
NIXL plugins (GDS, POSIX, object stores, libfabric, ...) and their libraries,
InfiniBand UCX modules, static libraries, headers, perftest binaries.
RECORD keeps the original hashes of the kept files. Usage: python3 tools/device/trim_wheels.py SRC_DIR DST_DIR
(tools/device/wheels.sh runs it)
"""
import fnmatch, os, re, subprocess, sys, tempfile, zipfile

from wheel_repack import repack

SRC, DST = sys.argv[1], sys.argv[2]

def needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)

def elf_closure(root, roots):
    """Names of files under root reachable by NEEDED from roots (paths relative to root)."""
    by_name = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            by_name.setdefault(f, []).append(os.path.relpath(os.path.join(d, f), root))
    keep, todo = set(), list(roots)
    while todo:
        rel = todo.pop()
        if rel in keep:
            continue
        keep.add(rel)
        for n in needed(os.path.join(root, rel)):
            for hit in by_name.get(n, []):
                todo.append(hit)
    return keep

def rules(name):
    if name.startswith("nixl_cu13-"):
        drop_dirs = ("nixl_ep_cu13/", "nixl_cu13.scripts/", "nixl_cu13-1.5.1.data/")
        def elf_roots(files):
            r = [f for f in files if re.match(r"nixl_cu13/[^/]+\.so$", f)]
            r += [f for f in files if re.match(r"\.nixl_cu13\.mesonpy\.libs/[^/]+\.so[.0-9]*$", f)]
            r += [f for f in files if f.endswith("/libplugin_UCX.so")]
            r += [f for f in files if re.match(r"nixl_cu13\.libs/ucx/lib(uct_cuda|ucm_cuda|uct_cma)\.so", f)]
            return r
        return drop_dirs, elf_roots
    if name.startswith("libucx_cu13-"):
        return (), None
    return (), None

DROP_GLOBS = ["*.a", "*.la", "*/include/*", "*/cmake/*", "*/pkgconfig/*", "*perftest*", "*/bin/io_demo",
              "*/bin/ucx_read_profile", "ucxx/benchmarks/*", "ucxx/examples/*"]

os.makedirs(DST, exist_ok=True)
for whl in sorted(os.listdir(SRC)):
    if not whl.endswith(".whl"):
        continue
    src = os.path.join(SRC, whl)
    with zipfile.ZipFile(src) as z:
        infos = z.infolist()
        files = [i.filename for i in infos]
        drop_dirs, elf_roots = rules(whl)
        keep = {f for f in files if not f.startswith(drop_dirs) and not any(fnmatch.fnmatch(f, g) for g in DROP_GLOBS)}
        if elf_roots:
            with tempfile.TemporaryDirectory() as tmp:
                z.extractall(tmp)
                closure = elf_closure(tmp, elf_roots(files))
            is_elf = lambda f: re.search(r"\.so($|\.)", f) is not None
            keep = {f for f in keep if not is_elf(f) or f in closure}
        out = os.path.join(DST, whl)
        kept = repack(z, keep, out)
    print(f"{whl}: {len(files)} -> {kept} files, {os.path.getsize(src)/2**20:.1f} -> {os.path.getsize(out)/2**20:.1f} MiB")
