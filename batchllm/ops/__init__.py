"""Attention and KV-cache operators: Triton kernels and their PyTorch references (docs/design.md).

Import the modules directly: this package does not import triton, so a CPU process can set
TRITON_INTERPRET first.
"""
