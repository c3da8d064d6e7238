"""Repack the FlashInfer 0.7.2 wheels without files its GDN prefill on sm90 never reads, stored (not deflated), for
wheel_parts.py to compress as one xz stream (tools/device/flashinfer_wheels.sh runs both).

Why these files can go (read from the 0.7.2 sources): `flashinfer.gdn_prefill.chunk_gated_delta_rule` on sm90 runs
`gdn_kernels/delta_rule_dsl/delta_rule_sm90.py` (or `delta_rule_cp_sm90.py` when its context-parallel heuristic
picks CP) and, for `use_qk_l2norm_in_kernel`, `gdn_kernels/qk_l2norm.py`: CuTe DSL kernels compiled in-process by
nvidia-cutlass-dsl's bundled MLIR/LLVM (`cute.compile`), cached as exported objects loaded through
`libcute_dsl_runtime.so` and tvm_ffi. No nvcc, ninja or C compiler runs on that path, so nothing reads

- flashinfer-python: `flashinfer/data/` (250 MB of C++/CUDA sources in `csrc/`, the CUTLASS, CCCL and spdlog headers
  and FlashInfer's own `include/`: the inputs of its nvcc JIT for the other operators), every other `*.cu`/`*.cuh`/
  `*.c`/`*.h` (CUDA and C sources of experimental nvcc-compiled kernels: sm110 XQA, MLA decode, MoE, b12x loaders) and
  the cuDNN "frost" MoE kernel tables (`fused_moe/backends/cudnn_frost/artifacts/`, 17 MB of JSON read only by that
  MoE backend). Every `.py` file stays: `import flashinfer.gdn_prefill` runs `flashinfer/__init__.py`, which imports
  nearly every operator's module.
- nvidia-cutlass-dsl-libs-cu13: `cu13/lib/stubs/` (empty-bodied `libcute_dsl_runtime.so` link stubs for cross-
  compiling ahead-of-time exports to AArch64, `cute/export/aot_config.py`), and `cu13/lib/*.a` and `cu13/include/`
  (the static runtime and header for linking an exported kernel into a C++ program). The two shared objects that
  are 99.9 % of the wheel stay: `_cutlass_ir.cu13*.so` (the compiler) and `cu13/lib/libcute_dsl_runtime.so` (which
  `cutlass.runtime.load_module` loads for every compiled kernel).

Every other wheel is rewritten stored and unchanged in content. RECORD keeps the original hashes of the kept files.
Usage: python3 tools/device/trim_fi_wheels.py SRC_DIR DST_DIR
"""
import sys
import zipfile

from wheel_repack import trim_dir

DROP = {  # wheel name prefix -> globs of files to leave out (fnmatch: `*` also matches `/`)
    "flashinfer_python-": ["flashinfer/data/*", "*.cu", "*.cuh", "*.c", "*.h",
                           "flashinfer/fused_moe/backends/cudnn_frost/artifacts/*"],
    "nvidia_cutlass_dsl_libs_cu13-": ["nvidia_cutlass_dsl/cu13/lib/stubs/*", "nvidia_cutlass_dsl/cu13/lib/*.a",
                                      "nvidia_cutlass_dsl/cu13/include/*"],
}

if __name__ == "__main__":
    trim_dir(sys.argv[1], sys.argv[2], DROP, compression=zipfile.ZIP_STORED)
