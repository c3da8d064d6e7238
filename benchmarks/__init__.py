"""Research probes and GPU test-machine scripts (not part of the installed package).

Run from the repository root, e.g. ``python -m benchmarks.gdn.split_probe --help`` or
``bash benchmarks/device/gdn.sh`` on the GPU machine.
"""
