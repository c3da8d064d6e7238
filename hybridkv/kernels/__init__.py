"""Kernels for the hybrid layers whose state hybridkv moves (GDN today).

Each kernel has a pure-torch reference beside it; CPU tensors run the reference, CUDA tensors the
Triton kernel. Importing this package imports neither torch nor Triton.
"""
