"""The HF transformers `generate` peer: static batches, sdpa attention, its own random weights."""

from __future__ import annotations

import time


def hf_peer_row(engine, workload_label: str, model: str, prompts: list[list[int]], max_tokens, num_peer: int,
                bound_seconds: float) -> dict:
    """Time HF transformers `generate` on the same architecture (its own random weights: speed does
    not depend on them) over the first num_peer requests as one left-padded static batch, greedy,
    every member generating the batch's longest max_tokens as a static batch does; scale the time
    to the workload."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    arch, device = engine.arch, engine.device
    size = min(num_peer, len(prompts))
    output_tokens = max(max_tokens[:size])
    config = LlamaConfig(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
                         intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_layers,
                         num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
                         head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta,
                         max_position_embeddings=arch.max_position_embeddings,
                         tie_word_embeddings=arch.tie_word_embeddings)
    with device:
        hf_model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", torch_dtype=engine.dtype)
    hf_model.eval()
    cuda = device.type == "cuda"
    batch = prompts[:size]
    width = max(len(p) for p in batch)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
    with torch.inference_mode():
        hf_model.generate(input_ids[:1, :16], attention_mask=mask[:1, :16], max_new_tokens=2, do_sample=False,
                          pad_token_id=0)  # warm-up
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        hf_model.generate(input_ids, attention_mask=mask, max_new_tokens=output_tokens,
                          min_new_tokens=output_tokens, do_sample=False, pad_token_id=0)
        if cuda:
            torch.cuda.synchronize()
    measured = time.perf_counter() - started
    del hf_model
    if cuda:
        torch.cuda.empty_cache()
    scaled = measured * len(prompts) / size
    return {"workload": workload_label, "requests": len(prompts), "model": model,
            "policy": f"hf-generate (static batch {size}, sdpa; scaled)",
            "seconds": round(scaled, 3), "req_per_s": round(len(prompts) / scaled, 2),
            "output_tok_per_s": round(sum(max_tokens) / scaled, 1),
            "measured_seconds": round(measured, 3), "time_over_bound": round(scaled / bound_seconds, 2)}
