"""gather_dense_kv (Triton) against gather_dense_kv_reference: a dense call's KV, exactly."""

import pytest
import torch

from batchllm.ops.kv_gather import gather_dense_kv, gather_dense_kv_reference


def _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, v = (torch.randn(shape, generator=generator) * 3 for _ in range(2))
    return k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)


def _blocks(num_blocks, count, device, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=generator)[:count].to(device=device, dtype=torch.int32)


CASES = [  # (batch, offset, kv_len, padded_len)
    (1, 0, 40, 40),  # whole blocks from the first position
    (1, 5, 37, 37),  # a run that starts inside its first block, ends inside its last
    (1, 3, 21, 32),  # a causal square padded with zero positions
    (3, 7, 18, 24),  # a batch of squares, each its own run of blocks
    (2, 0, 0, 16),  # nothing gathered: only padding
]


@pytest.mark.parametrize("batch,offset,kv_len,padded_len", CASES)
@pytest.mark.parametrize("cache_dtype,out_dtype", [
    (torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float8_e4m3fn, torch.float16),
    (torch.float8_e4m3fn, torch.float32)])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 32, 16), (3, 64, 8)])
def test_gather_matches_reference(device, batch, offset, kv_len, padded_len, cache_dtype, out_dtype, num_kv_heads,
                                  head_dim, block_size):
    num_blocks = 40
    k_cache, v_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, device)
    per_run = -(-(offset + kv_len) // block_size) or 1
    blocks = _blocks(num_blocks, batch * per_run, device)
    key, value = gather_dense_kv(k_cache, v_cache, blocks, batch, offset, kv_len, padded_len, out_dtype)
    ref_key, ref_value = gather_dense_kv_reference(k_cache, v_cache, blocks, batch, offset, kv_len, padded_len,
                                                   out_dtype)
    assert key.shape == (batch, padded_len, num_kv_heads, head_dim) and key.dtype == out_dtype
    assert key.is_contiguous() and value.is_contiguous()
    assert torch.equal(key, ref_key) and torch.equal(value, ref_value)
    assert not key[:, kv_len:].any() and not value[:, kv_len:].any()  # the padding is zeros

@pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 conversions are checked on the GPU")
def test_gather_fp8_to_bfloat16_matches_reference(device):
    k_cache, v_cache = _caches(64, 16, 8, 128, torch.float8_e4m3fn, device)
    blocks = _blocks(64, 2 * 20, device)
    got = gather_dense_kv(k_cache, v_cache, blocks, 2, 9, 300, 320, torch.bfloat16)
    ref = gather_dense_kv_reference(k_cache, v_cache, blocks, 2, 9, 300, 320, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_gather_rejects_runs_too_short(device):
    k_cache, v_cache = _caches(8, 16, 2, 32, torch.float32, device)
    blocks = _blocks(8, 2, device)
    with pytest.raises(ValueError, match="do not fit"):
        gather_dense_kv(k_cache, v_cache, blocks, 1, 10, 30, 30, torch.float32)
    with pytest.raises(ValueError, match="equal length"):
        gather_dense_kv(k_cache, v_cache, blocks[:1], 2, 0, 4, 4, torch.float32)


def test_gather_writes_into_given_slices(device):
    """out=: two calls' KV gathered one after the other into one ragged buffer (FP8 to FP8, as
    they are), each exactly its own gather, nothing written outside its slice."""
    k_cache, v_cache = _caches(30, 16, 2, 32, torch.float8_e4m3fn, device)
    blocks = _blocks(30, 7, device)
    key = torch.zeros(3 + 2 * 20 + 37, 2, 32, dtype=torch.float8_e4m3fn, device=device)
    value = torch.zeros_like(key)
    views = tuple(t[3:3 + 40].view(2, 20, 2, 32) for t in (key, value))
    gather_dense_kv(k_cache, v_cache, blocks[:4], 2, 5, 20, 20, torch.float8_e4m3fn, out=views)
    views2 = tuple(t[43:80].view(1, 37, 2, 32) for t in (key, value))
    gather_dense_kv(k_cache, v_cache, blocks[4:], 1, 0, 37, 37, torch.float8_e4m3fn, out=views2)
    ref1 = gather_dense_kv_reference(k_cache, v_cache, blocks[:4], 2, 5, 20, 20, torch.float8_e4m3fn)
    ref2 = gather_dense_kv_reference(k_cache, v_cache, blocks[4:], 1, 0, 37, 37, torch.float8_e4m3fn)
    as_bytes = lambda t: t.view(torch.uint8)
    assert torch.equal(as_bytes(key[3:43]), as_bytes(ref1[0].reshape(40, 2, 32)))
    assert torch.equal(as_bytes(value[43:80]), as_bytes(ref2[1].reshape(37, 2, 32)))
    assert not as_bytes(key[:3]).any() and not as_bytes(value[:3]).any()
    with pytest.raises(ValueError, match="out must be"):
        gather_dense_kv(k_cache, v_cache, blocks[4:], 1, 0, 37, 37, torch.float16, out=views2)
