"""store_kv (Triton) against store_kv_reference."""

import pytest
import torch

from batchllm.ops.kv_store import store_kv
from batchllm.ops.reference import store_kv_reference
from synthetic_batch import SeqSpec, make_batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(3, 64, 16), (2, 32, 32)])
def test_store_kv_matches_reference(device, dtype, num_kv_heads, head_dim, block_size):
    seqs = [SeqSpec(5, 21, 0, 0, True), SeqSpec(3, 24, 21, 0), SeqSpec(1, 40, 0), SeqSpec(2, 17, 0)]
    b = make_batch(seqs, num_heads=num_kv_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   block_size=block_size, dtype=dtype, device=device)
    slots = b.slot_mapping.clone()
    slots[1] = -1  # skipped row
    k_ref, v_ref = b.k_cache.clone(), b.v_cache.clone()
    store_kv_reference(b.key, b.value, k_ref, v_ref, slots)
    store_kv(b.key, b.value, b.k_cache, b.v_cache, slots)
    assert torch.equal(b.k_cache, k_ref) and torch.equal(b.v_cache, v_ref)


def test_store_kv_strided_rows(device):
    # key/value as views of a fused qkv projection: non-contiguous token stride
    b = make_batch([SeqSpec(4, 10)], num_heads=2, num_kv_heads=2, head_dim=32, block_size=16, device=device)
    kv = torch.randn(4, 2, 2, 32, device=device)
    k_ref, v_ref = b.k_cache.clone(), b.v_cache.clone()
    store_kv_reference(kv[:, 0], kv[:, 1], k_ref, v_ref, b.slot_mapping)
    store_kv(kv[:, 0], kv[:, 1], b.k_cache, b.v_cache, b.slot_mapping)
    assert torch.equal(b.k_cache, k_ref) and torch.equal(b.v_cache, v_ref)


def test_store_kv_rejects_bad_shapes(device):
    b = make_batch([SeqSpec(2, 2)], num_heads=2, num_kv_heads=2, head_dim=32, block_size=16, device=device)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(b.key, b.value, b.k_cache, b.v_cache, b.slot_mapping.int())
    with pytest.raises(ValueError, match="cache heads"):
        store_kv(b.key[:, :1], b.value[:, :1], b.k_cache, b.v_cache, b.slot_mapping)


@pytest.mark.gpu
def test_store_kv_bf16_llama_shapes():
    seqs = [SeqSpec(300, 1300, 1000, 0), SeqSpec(1, 2049, 2048, 1)] + [SeqSpec(1, 500 + i) for i in range(64)]
    b = make_batch(seqs, num_heads=8, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda")
    k_ref, v_ref = b.k_cache.clone(), b.v_cache.clone()
    store_kv_reference(b.key, b.value, k_ref, v_ref, b.slot_mapping)
    store_kv(b.key, b.value, b.k_cache, b.v_cache, b.slot_mapping)
    assert torch.equal(b.k_cache, k_ref) and torch.equal(b.v_cache, v_ref)
