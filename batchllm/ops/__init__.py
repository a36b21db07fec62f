"""Attention and KV-cache operators: Triton kernels and their PyTorch references.

Modules (import them directly; this package does not import triton, so a CPU process can set
TRITON_INTERPRET first):
  reference.py         PyTorch oracles (also the engine's CPU path)
  kv_store.py          store_kv(key, value, k_cache, v_cache, slot_mapping)
  work_list.py         build_prefix_shared_plan(...) -> PrefixSharedPlan (numpy); .to(device)
  plan_layout.py       the plan's one device buffer (also the CUDA graphs' static buffers)
  prefix_attention.py  prefix_shared_attention (BatchLLM section 5)
  paged_attention.py   paged_attention / build_paged_plan (no sharing knowledge)
  attention_kernels.py the Triton kernels; tile_config.py per-part tile sizes
"""
