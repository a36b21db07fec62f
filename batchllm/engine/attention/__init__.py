"""The engine's attention backends (docs/design.md, "The engine and the model runner"):

    protocol.py        AttentionBackend (what the runner and PagedAttention call) and AttentionMetadata
    reference.py       `reference`: the PyTorch oracle, one sequence at a time
    batched_torch.py   `torch`: the reference's math batched into padded SDPA calls (the CPU default)
    triton_backend.py  `triton`, `fused` and `xqa`: the Triton work-list kernels (the GPU default: fused, or
                       xqa where it runs)
    paged.py           PagedAttention, the model's AttentionFn: store the step's K/V, then attend
    select.py          select_backend: a backend by name (what "auto" becomes)
"""
