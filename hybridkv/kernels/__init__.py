"""Kernels, each with a torch reference beside it (its oracle): the hybrid layers whose state hybridkv moves
(`gdn`: CPU tensors run the reference, CUDA tensors the Triton kernel), and the staging copier's row gather
(`staging`: the copier picks the kernel or torch's indexing on a GPU; host memory copies on numpy).

Importing this package imports neither torch nor Triton.
"""
