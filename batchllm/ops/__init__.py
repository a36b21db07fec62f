"""Attention and KV-cache operators: Triton kernels and their PyTorch references."""
