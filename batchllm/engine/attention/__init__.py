"""The engine's attention backends (docs/design.md, "The engine and the model runner"):

    protocol.py        AttentionBackend (what the runner and PagedAttention call) and AttentionMetadata
    reference.py       `reference`: the PyTorch oracle, one sequence at a time
    batched_torch.py   `torch`: the reference's math batched into padded SDPA calls (the CPU default)
    triton_backend.py  `triton` and `fused`: the Triton work-list kernels (the GPU default: fused)
    paged.py           PagedAttention, the model's AttentionFn: store the step's K/V, then attend
    select.py          make_backend: a backend by name
"""
