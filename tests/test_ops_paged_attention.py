"""Plain paged attention (no sharing knowledge) against paged_attention_reference."""

import numpy as np
import pytest
import torch

from batchllm.attention_plan.work_list import build_prefix_shared_plan as build_paged_plan
from batchllm.ops.plan_device import plan_to_device
from batchllm.ops.reference import paged_attention_reference
from op_references import paged_attention
from synthetic_batch import SeqSpec, make_batch

CASES = {
    "decode": [SeqSpec(1, 1), SeqSpec(1, 16), SeqSpec(1, 17), SeqSpec(1, 70)],
    "prefill": [SeqSpec(20, 20), SeqSpec(7, 39), SeqSpec(16, 48)],
    # shared_kv_len > 0 with no group knowledge: the addressing rule still holds
    "mixed_shared_blocks": [SeqSpec(1, 50, 21), SeqSpec(5, 26, 21), SeqSpec(9, 9), SeqSpec(1, 33, 32)],
}


def _check(seqs, heads, dtype, device, block_size=16, tol=2e-5, **plan_kwargs):
    num_heads, num_kv_heads, head_dim = heads
    b = make_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   block_size=block_size, dtype=dtype, device=device)
    scale = head_dim ** -0.5
    meta = (b.query_start_loc, b.seq_lens, b.shared_kv_lens, b.block_tables)
    if plan_kwargs:
        plan = plan_to_device(build_paged_plan(*(m.cpu() for m in meta), block_size=block_size, num_kv_heads=num_kv_heads,
                                               num_heads=num_heads, head_dim=head_dim, **plan_kwargs), device)
        out = paged_attention(b.query, b.k_cache, b.v_cache, *meta, scale, plan=plan)
    else:
        out = paged_attention(b.query, b.k_cache, b.v_cache, *meta, scale)
    ref = paged_attention_reference(b.query.float(), b.k_cache.float(), b.v_cache.float(), *meta, scale)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_matches_reference(device, case, dtype):
    _check(CASES[case], (9, 3, 64), dtype, device, tol=2e-5 if dtype == torch.float32 else 3e-3)


def test_paged_split_kv_and_mha(device):
    _check(CASES["mixed_shared_blocks"], (2, 2, 32), torch.float32, device, kv_split_tokens=16)


def test_paged_block_size_32(device):
    _check(CASES["prefill"] + CASES["decode"], (8, 2, 32), torch.float32, device, block_size=32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_llama_shapes_gpu(dtype):
    rng = np.random.default_rng(1)
    seqs = [SeqSpec(1, int(rng.integers(1, 4000))) for _ in range(100)]
    seqs += [SeqSpec(512, 512), SeqSpec(300, 2348, 2048), SeqSpec(1, 4000, 2048)]
    _check(seqs, (32, 8, 128), dtype, "cuda", tol=2e-2 if dtype == torch.bfloat16 else 3e-3)
