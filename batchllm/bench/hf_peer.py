"""The HF transformers `generate` peer: static batches, sdpa attention, its own random weights."""

from __future__ import annotations

import time


def time_hf_generate(arch, prompts: list[list[int]], output_tokens: int, device, dtype) -> float:
    """HF transformers `generate` on the same architecture (its own random weights: speed does
    not depend on them), one left-padded static batch, greedy, exactly output_tokens new tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
                         intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_layers,
                         num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
                         head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta,
                         max_position_embeddings=arch.max_position_embeddings,
                         tie_word_embeddings=arch.tie_word_embeddings)
    with device:
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", torch_dtype=dtype)
    model.eval()
    cuda = device.type == "cuda"
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        model.generate(input_ids[:1, :16], attention_mask=mask[:1, :16], max_new_tokens=2, do_sample=False,
                       pad_token_id=0)  # warm-up
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        model.generate(input_ids, attention_mask=mask, max_new_tokens=output_tokens, min_new_tokens=output_tokens,
                       do_sample=False, pad_token_id=0)
        if cuda:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    del model
    if cuda:
        torch.cuda.empty_cache()
    return seconds


def hf_peer_row(engine, workload_label: str, model: str, prompts: list[list[int]], max_tokens, num_peer: int,
                bound_seconds: float) -> dict:
    """Time `generate` on the first num_peer requests as one static batch (every member generates
    the batch's longest max_tokens, as a static batch does) and scale the time to the workload."""
    size = min(num_peer, len(prompts))
    output_tokens = max(max_tokens[:size])
    measured = time_hf_generate(engine.arch, prompts[:size], output_tokens, engine.device, engine.dtype)
    scaled = measured * len(prompts) / size
    return {"workload": workload_label, "requests": len(prompts), "model": model,
            "policy": f"hf-generate (static batch {size}, sdpa; scaled)",
            "seconds": round(scaled, 3), "req_per_s": round(len(prompts) / scaled, 2),
            "output_tok_per_s": round(sum(max_tokens) / scaled, 1),
            "measured_seconds": round(measured, 3), "time_over_bound": round(scaled / bound_seconds, 2)}
