"""Device probes of the GDN kernels (`hybridkv.kernels.gdn`). Each module runs as ``python -m tools.gdn.<name>`` from
the repository root on a CUDA machine; `schedules` also holds the shared inputs and error measure. README.md lists
them."""
