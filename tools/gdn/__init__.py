"""Device probes of the GDN kernels (`hybridkv.kernels.gdn`): schedules, forms and launch variants measured
side by side with FLA on a CUDA machine. Each module runs as ``python -m tools.gdn.<name>`` from the
repository root; `schedules` holds the shared command line, inputs and error measure. Results: README.md here.
"""
