"""The FP8 (e4m3) KV cache: the quantization rule, its sizing, the store and attention kernels on
an e4m3 cache against the references, and the engine backends on one."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from batchllm.attention_plan.tile_config import decode_tile_config
from batchllm.attention_plan.work_list import build_prefix_shared_plan
from batchllm.engine.attention.paged import PagedAttention
from batchllm.engine.attention.protocol import AttentionMetadata
from batchllm.engine.attention.select import AttentionShape, select_backend
from batchllm.engine.kv_cache import KVCache, kv_bytes_per_token
from batchllm.ops.fp8 import FP8_MAX
from batchllm.ops.kv_quant import dequantize_e4m3, quantize_e4m3
from batchllm.ops.kv_store import store_kv
from batchllm.ops.plan_device import device_num_sms, plan_to_device
from batchllm.ops.prefix_attention import prefix_shared_attention
from batchllm.ops.reference import paged_attention_reference, store_kv_reference
from graph_helpers import capture_and_replay
from synthetic_batch import SeqSpec, make_batch

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.02, 0.015  # not powers of two: the scales must really be applied
# The Triton interpreter's float -> e4m3 conversion is not the hardware's: it rounds ties up, not
# to even, and a round-up that carries into the exponent can halve the value (7.75 -> 4.0). Its
# e4m3 -> float conversion is exact, so the attention kernels run on CPU; the store kernel only
# on inputs that need no rounding.
INTERPRETER_ROUNDING = ("the Triton interpreter rounds float -> e4m3 wrongly (ties not to even, 7.75 -> 4.0): "
                        "the store kernel's rounding is tested on a CUDA device only")
gpu_only_rounding = pytest.mark.skipif(not torch.cuda.is_available(), reason=INTERPRETER_ROUNDING)

# A mixed step: a group's prefix chunk with its members' first chunks, a second group's decode
# rows, a chunked prefill (a later chunk of an ungrouped seq) and ungrouped decodes.
MIXED = [SeqSpec(13, 21, 0, 0, True), SeqSpec(6, 27, 21, 0), SeqSpec(1, 40, 21, 0), SeqSpec(1, 50, 32, 1),
         SeqSpec(1, 70, 32, 1), SeqSpec(24, 64), SeqSpec(1, 90), SeqSpec(1, 17)]


def _bytes(t: torch.Tensor) -> list[int]:
    return t.view(torch.uint8).flatten().tolist()


# ---------------------------------------------------------------- the quantization rule (CPU)

def test_e4m3_bytes_of_known_values():
    values = torch.tensor([0.0, 1.0, -1.0, 0.1, 0.3, 17.0, 19.0, 448.0, 1e6, -1e6, float("inf"), 2.0 ** -9,
                           3e-3, 2.0 ** -11])
    # 17 and 19 are ties (16|18, 18|20): to the even mantissa. 3e-3 is a subnormal (2^-8), 2^-11 underflows.
    expected = [0x00, 0x38, 0xB8, 0x1D, 0x2A, 0x58, 0x5A, 0x7E, 0x7E, 0xFE, 0x7E, 0x01, 0x02, 0x00]
    assert _bytes(quantize_e4m3(values, 1.0)) == expected
    assert _bytes(quantize_e4m3(values * 0.5, 0.5)) == expected  # x / scale, exact for a power of two
    assert _bytes(quantize_e4m3(torch.tensor([0.75, -300.0]), 0.25)) == [0x44, 0xFE]  # 3.0; -1200 saturates
    assert dequantize_e4m3(torch.tensor([0x38, 0x7E, 0xFE, 0x01], dtype=torch.uint8).view(FP8), 0.5).tolist() == [
        0.5, 224.0, -224.0, 2.0 ** -10]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_store_quantizes_with_the_scale(dtype):
    b = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=dtype)
    slots = b.slot_mapping.clone()
    slots[3] = -1  # a skipped row
    k8 = torch.full(b.k_cache.shape, 0.5, dtype=FP8)
    v8 = k8.clone()
    store_kv_reference(b.key, b.value, k8, v8, slots, K_SCALE, V_SCALE)
    flat_k, flat_v = k8.view(-1, 2, 32), v8.view(-1, 2, 32)
    keep = slots >= 0
    for flat, rows, scale in ((flat_k, b.key, K_SCALE), (flat_v, b.value, V_SCALE)):
        stored = flat[slots[keep]]
        expected = (rows[keep].float() / torch.tensor(scale)).clamp(-448, 448).to(FP8)
        assert _bytes(stored) == _bytes(expected)
        # round trip: half an e4m3 step, 2^-4 relative in the normal range, 2^-10 * scale below 2^-6
        x = rows[keep].float()
        error = (dequantize_e4m3(stored, scale) - x).abs()
        bound = torch.maximum(x.abs() * 2.0 ** -4, torch.tensor(2.0 ** -10 * scale)) * (1 + 1e-6)
        assert torch.all(error <= bound)
        assert torch.all(flat[slots[3]].float() == 0.5)  # the skipped row's slot is untouched


def test_reference_store_saturates_instead_of_nan():
    k8 = torch.zeros(2, 4, 1, 16, dtype=FP8)
    v8 = torch.zeros_like(k8)
    big = torch.tensor([1.0, -1.0, 1e4, float("inf")]).repeat(4)[None, None, :] * (449 * K_SCALE)
    store_kv_reference(big, big, k8, v8, torch.tensor([5]), K_SCALE, V_SCALE)
    stored = k8.view(-1, 1, 16)[5].float()
    assert not torch.isnan(stored).any()
    assert stored.abs().eq(FP8_MAX).all()
    assert dequantize_e4m3(k8.view(-1, 1, 16)[5], K_SCALE).abs().max().item() == pytest.approx(448 * K_SCALE)


def test_kv_bytes_per_token_halves_and_tokens_double():
    bf16 = kv_bytes_per_token(32, 8, 128, torch.bfloat16)
    fp8 = kv_bytes_per_token(32, 8, 128, FP8)
    assert (bf16, fp8) == (2 * 32 * 8 * 128 * 2, 2 * 32 * 8 * 128)
    budget_bytes = 40 * 2 ** 30
    assert budget_bytes // fp8 == 2 * (budget_bytes // bf16)


def test_allocate_fp8_cache_and_scale_checks():
    cache = KVCache.allocate(2, 3, 16, 2, 32, FP8, torch.device("cpu"), k_scale=K_SCALE, v_scale=V_SCALE)
    assert cache.k.dtype == cache.v.dtype == FP8 and cache.is_fp8
    assert (cache.k_scale, cache.v_scale, cache.num_blocks) == (K_SCALE, V_SCALE, 3)
    assert cache.k.element_size() == 1
    plain = KVCache.allocate(2, 3, 16, 2, 32, torch.float16, torch.device("cpu"))
    assert (plain.k_scale, plain.v_scale, plain.is_fp8) == (1.0, 1.0, False)
    with pytest.raises(ValueError, match="float8_e4m3fn cache only"):
        KVCache.allocate(2, 3, 16, 2, 32, torch.float16, torch.device("cpu"), k_scale=0.5)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite float > 0"):
            KVCache.allocate(1, 1, 16, 1, 16, FP8, torch.device("cpu"), v_scale=bad)


# ---------------------------------------------------------------- kernels against the references

def _fp8_caches(b):
    """The batch's random caches quantized: the KV history of the step."""
    return quantize_e4m3(b.k_cache, K_SCALE), quantize_e4m3(b.v_cache, V_SCALE)


def test_store_kv_kernel_on_e4m3_grid(device):
    """Rows whose x / scale are e4m3 values (scales 2^-3 and 2^-5), or past 448 * scale: no rounding
    to do, so the kernel equals the reference byte for byte, in the interpreter too."""
    k_scale, v_scale = 0.125, 2.0 ** -5
    b = make_batch(MIXED, num_heads=6, num_kv_heads=3, head_dim=64, block_size=16, device=device)
    codes = torch.randint(0, 256, b.key.shape, generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    grid = codes.view(FP8).float().to(device)
    key, value = grid * k_scale, grid * v_scale
    key[0, 0, :4] = torch.tensor([449.0, -1e4, 1e9, -float("inf")]) * k_scale  # saturate
    slots = b.slot_mapping.clone()
    slots[2] = -1
    k_ref, v_ref = _fp8_caches(b)
    k8, v8 = k_ref.clone(), v_ref.clone()
    store_kv_reference(key, value, k_ref, v_ref, slots, k_scale, v_scale)
    store_kv(key, value, k8, v8, slots, k_scale, v_scale)
    assert _bytes(k8) == _bytes(k_ref) and _bytes(v8) == _bytes(v_ref)


@gpu_only_rounding
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_kv_kernel_rounds_like_reference_gpu(dtype):
    b = make_batch(MIXED, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype, device="cuda")
    key, value = b.key * 3, b.value * 3  # some rows saturate (past 448 * 0.015 = 6.72)
    k_ref, v_ref = _fp8_caches(b)
    k8, v8 = k_ref.clone(), v_ref.clone()
    store_kv_reference(key, value, k_ref, v_ref, b.slot_mapping, K_SCALE, V_SCALE)
    store_kv(key, value, k8, v8, b.slot_mapping, K_SCALE, V_SCALE)
    assert torch.equal(k8.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), v_ref.view(torch.uint8))
    assert not torch.isnan(k8.float()).any()


def _plan(b, heads, device, groups: bool, tile=None):
    num_heads, num_kv_heads, head_dim = heads
    meta = b.metadata_numpy()
    if not groups:
        meta["group_ids"], meta["is_prefix"] = None, None
    return plan_to_device(build_prefix_shared_plan(**meta, block_size=b.k_cache.shape[1], num_kv_heads=num_kv_heads,
                                                   num_heads=num_heads, head_dim=head_dim, tile=tile,
                                                   num_sms=device_num_sms(device)), device)


def _reference(b, k_cache, v_cache, scale, k_scale=1.0, v_scale=1.0):
    return paged_attention_reference(b.query.float(), k_cache, v_cache, b.query_start_loc, b.seq_lens,
                                     b.shared_kv_lens, b.block_tables, scale, k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("tile", ["default", "decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_kernel_on_e4m3_cache_matches_reference(device, dtype, tile):
    """Fused prefix-shared attention with fp32 / fp16 queries on an e4m3 cache (one launch, or
    the class-split launches of decode steps and of the FP8 prefill table) equals the reference on
    the same cache."""
    from batchllm.attention_plan.tile_config import decode_tile_config, prefill_tile_config

    heads = (9, 3, 64)
    b = make_batch(MIXED, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype, device=device)
    k8, v8 = _fp8_caches(b)
    store_kv_reference(b.key, b.value, k8, v8, b.slot_mapping, K_SCALE, V_SCALE)
    tiles = {"default": None, "decode": decode_tile_config(64, 3), "prefill": prefill_tile_config(64, 3, kv_fp8=True)}
    plan = _plan(b, heads, device, groups=True, tile=tiles[tile])
    out = prefix_shared_attention(b.query, k8, v8, plan, 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    ref = _reference(b, k8, v8, 0.125, K_SCALE, V_SCALE)
    f16_mmas = tile == "prefill"  # the FP8 tables' MMAs run in float16 whatever the query dtype
    tol = 2e-5 if dtype == torch.float32 and not f16_mmas else 3e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_attention_validates_fp8_caches(device):
    b = make_batch(MIXED[:3], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float16,
                   device=device)
    plan = _plan(b, (4, 2, 32), device, groups=True)
    k8, v8 = _fp8_caches(b)
    cases = [
        ((b.query, b.k_cache.float(), b.v_cache.float()), {}, "query/cache dtypes differ"),
        ((b.query, b.k_cache.to(torch.float8_e5m2), b.v_cache.to(torch.float8_e5m2)), {}, "float8_e4m3fn"),
        ((b.query, k8, b.v_cache), {}, "k_cache/v_cache dtypes differ"),
        ((b.query, b.k_cache, b.v_cache), {"k_scale": 0.5}, "float8_e4m3fn cache only"),
        ((b.query, k8, v8), {"v_scale": 0.0}, "finite float > 0"),
        ((b.query.to(torch.float64), k8, v8), {}, "unsupported dtype"),
    ]
    for (query, k_cache, v_cache), scales, message in cases:
        with pytest.raises(ValueError, match=message):
            prefix_shared_attention(query, k_cache, v_cache, plan, 0.1, **scales)
    with pytest.raises(ValueError, match="float8_e4m3fn cache only"):
        store_kv(b.key, b.value, b.k_cache, b.v_cache, b.slot_mapping, k_scale=0.5)
    with pytest.raises(ValueError, match="float8_e4m3fn cache stores"):
        store_kv(b.key.to(FP8), b.value.to(FP8), k8, v8, b.slot_mapping)


# ---------------------------------------------------------------- engine backends (CPU)

@pytest.mark.parametrize("backend_name", ["reference", "torch"])
def test_cpu_backends_on_an_fp8_cache(backend_name):
    """PagedAttention stores the step quantized with the cache's scales and attends over the
    dequantized cache: the reference math on the same e4m3 cache."""
    b = make_batch(MIXED, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)
    k8, v8 = _fp8_caches(b)
    cache = KVCache(torch.stack([k8, k8]), torch.stack([v8, v8]), K_SCALE, V_SCALE)
    backend = select_backend(backend_name, torch.device("cpu"), AttentionShape(16, 6, 2, 32)).backend
    inputs = SimpleNamespace(**b.metadata_numpy(), num_tokens=b.query.shape[0])
    plan = backend.plan_to_device(backend.build_plan(inputs), torch.device("cpu"))
    metadata = AttentionMetadata(slot_mapping=b.slot_mapping, positions=torch.zeros_like(b.slot_mapping), plan=plan)
    out = PagedAttention(cache, metadata, backend, 0.2)(1, b.query, b.key, b.value)
    store_kv_reference(b.key, b.value, k8, v8, b.slot_mapping, K_SCALE, V_SCALE)
    assert _bytes(cache.k[1]) == _bytes(k8) and _bytes(cache.v[1]) == _bytes(v8)
    assert torch.equal(cache.k[0].view(torch.uint8), quantize_e4m3(b.k_cache, K_SCALE).view(torch.uint8))
    torch.testing.assert_close(out, _reference(b, k8, v8, 0.2, K_SCALE, V_SCALE), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- GPU: bf16 queries, the real kernels

@pytest.mark.gpu
@pytest.mark.parametrize("groups", [True, False], ids=["fused", "paged"])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)], ids=["llama", "smollm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_and_attend_on_fp8_cache_gpu(dtype, heads, groups):
    """store_kv then the fused (or plain paged) attention on an e4m3 cache equal the reference on
    the same cache; against the same step on a cache in the query dtype the error stays small."""
    num_heads, num_kv_heads, head_dim = heads
    seqs = MIXED + [SeqSpec(1, 300 + 37 * i, 256, 2) for i in range(12)] + [SeqSpec(130, 700, 512, 3)]
    b = make_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                   dtype=dtype, device="cuda")
    scale = head_dim ** -0.5
    plan = _plan(b, heads, "cuda", groups)
    k8, v8 = _fp8_caches(b)
    k_ref, v_ref = k8.clone(), v8.clone()
    store_kv(b.key, b.value, k8, v8, b.slot_mapping, K_SCALE, V_SCALE)
    store_kv_reference(b.key, b.value, k_ref, v_ref, b.slot_mapping, K_SCALE, V_SCALE)
    assert torch.equal(k8.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), v_ref.view(torch.uint8))
    out = prefix_shared_attention(b.query, k8, v8, plan, scale, k_scale=K_SCALE, v_scale=V_SCALE).float()
    ref = _reference(b, k8, v8, scale, K_SCALE, V_SCALE)
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)

    store_kv(b.key, b.value, b.k_cache, b.v_cache, b.slot_mapping)
    full = prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan, scale).float()
    error = out - full
    # e4m3 keeps 3 mantissa bits: ~3.5% relative RMS error on these random caches
    assert error.abs().max() <= 0.1 * full.abs().max()
    assert error.pow(2).mean().sqrt() <= 0.06 * full.pow(2).mean().sqrt()


# ---------------------------------------------------------------- decode tiles of an FP8 cache

# A decode step: a group of 5 members (20 packed rows: a BIG prefix tile), a group of 2, ungrouped rows
DECODE = ([SeqSpec(1, 90 + 23 * i, 48, 0) for i in range(5)] + [SeqSpec(1, 131, 64, 1), SeqSpec(1, 150, 64, 1)]
          + [SeqSpec(1, 300), SeqSpec(1, 17)])


def _decode_plan(b, heads, device, tile):
    """A decode step's plan as a CUDA graph launches it: persistent class-split launches of
    tile.graph_programs_per_sm programs per SM, the split-KV pieces sized for them (the backend's)."""
    num_heads, num_kv_heads, head_dim = heads
    plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=num_kv_heads, num_heads=num_heads,
                                    head_dim=head_dim, tile=tile, num_sms=device_num_sms(device),
                                    programs_per_sm=tile.graph_programs_per_sm)
    big, small = plan.class_lists()
    assert big.shape[0] > 0 and small.shape[0] > 0
    counts = torch.from_numpy(plan.item_counts()).to(device)
    return replace(plan_to_device(plan, device), num_items=counts,
                   persistent_programs=device_num_sms(device) * tile.graph_programs_per_sm)


def _decode_rows(kv_fp8: bool) -> dict[str, object]:
    """The decode tiles of the GPU table (Llama-3.1-8B heads) that run on a cache of this kind: the
    FP8 row (float16 MMAs, PTX conversion) and the bf16 row (tiles converted to the query dtype)
    on an FP8 cache; the bf16 row on a cache in the model dtype."""
    rows = {"bf16_row": decode_tile_config(128, 4, interpret=False)}
    if kv_fp8:
        rows["fp8_row"] = decode_tile_config(128, 4, interpret=False, kv_fp8=True)
    return rows


@pytest.mark.parametrize("kv_fp8", [True, False], ids=["fp8", "query_dtype"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_decode_row_matches_reference(device, dtype, kv_fp8):
    """Each decode tile of the GPU table (on the Llama-3.1-8B head shape) computes the reference's
    attention on the cache it runs on; with float16 MMAs, float32 queries are rounded to float16
    (and the probabilities), hence the float16 tolerance."""
    candidates = _decode_rows(kv_fp8)
    heads = (8, 2, 128)
    b = make_batch(DECODE, num_heads=8, num_kv_heads=2, head_dim=128, block_size=16, dtype=dtype, device=device)
    caches, scales = (_fp8_caches(b), (K_SCALE, V_SCALE)) if kv_fp8 else ((b.k_cache, b.v_cache), (1.0, 1.0))
    ref = _reference(b, *caches, 128 ** -0.5, *scales)
    for name, tile in candidates.items():
        out = prefix_shared_attention(b.query, *caches, _decode_plan(b, heads, device, tile), 128 ** -0.5,
                                      k_scale=scales[0], v_scale=scales[1])
        exact = dtype == torch.float32 and not (kv_fp8 and tile.fp8_conversion != "query")
        tol = 2e-5 if exact else 3e-3
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("magnitude", [1e5, 1e-6])
def test_float16_mmas_scale_the_query_tile_into_range(device, magnitude):
    """Query values of 1e5 overflow float16 and values of 1e-6 are float16 subnormals: the FP8
    row's float16 MMAs scale each query tile by a power of two first (and the softmax scale back),
    so the result is the reference's (the softmax scale over `magnitude` keeps the scores usual)."""
    from batchllm.attention_plan.tile_config import decode_tile_config

    heads = (8, 2, 32)
    tile = decode_tile_config(32, 4, kv_fp8=True)
    assert tile.fp8_conversion == "float16_ptx_v"
    b = make_batch(DECODE, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16, device=device)
    b.query.mul_(magnitude)
    k8, v8 = _fp8_caches(b)
    scale = 0.2 / magnitude
    out = prefix_shared_attention(b.query, k8, v8, _decode_plan(b, heads, device, tile), scale, k_scale=K_SCALE,
                                  v_scale=V_SCALE)
    torch.testing.assert_close(out, _reference(b, k8, v8, scale, K_SCALE, V_SCALE), atol=3e-3, rtol=3e-3)


def test_fp8_decode_row_on_the_gpu_table():
    """A float8_e4m3fn cache's decode tiles: the bf16 row's, with SMALL steps of 128 positions
    (the bytes of the bf16 row's 64) and split-KV pieces of at least 1024, float16 MMAs with V
    converted by PTX, 3 programs per SM; on heads of 128 in GQA groups of up to 4, SMALL items of
    up to 512 positions 4 to a program over 2 stages and 128 registers, else 3 stages and 168
    registers; BIG tiles in steps of 128 positions over 3 stages (values written out)."""
    from batchllm.attention_plan.tile_config import decode_tile_config

    bf16 = decode_tile_config(128, 4, interpret=False)
    unpacked = replace(bf16, small_n=128, min_kv_split_tokens=1024, small_max_registers=168, graph_programs_per_sm=3,
                       small_num_stages=3, fp8_conversion="float16_ptx_v", big_n=128, num_stages=3)
    assert decode_tile_config(128, 4, interpret=False, kv_fp8=True) == replace(
        unpacked, small_pack=4, small_pack_max_positions=512, small_num_stages=2, small_max_registers=128)
    assert decode_tile_config(128, 8, interpret=False, kv_fp8=True) == unpacked  # Llama-3.1-70B's groups of 8
    assert decode_tile_config(64, 3, interpret=False, kv_fp8=True).small_pack == 1
    assert (bf16.small_n, bf16.big_n, bf16.num_stages, bf16.small_max_registers, bf16.fp8_conversion,
            bf16.graph_programs_per_sm, bf16.small_pack) == (64, 64, 2, None, "query", 4, 1)
    cpu_row = decode_tile_config(64, 3, interpret=True, kv_fp8=True)  # the CPU tests' row
    assert (cpu_row.fp8_conversion, cpu_row.small_pack, cpu_row.small_n) == ("float16_ptx_v", 4, 64)


def test_decode_rows_fit_their_programs_per_sm():
    """A row with a register cap lets an SM hold its graph_programs_per_sm programs (65536
    registers an SM)."""
    for tile in (*_decode_rows(True).values(), *_decode_rows(False).values()):
        threads = tile.graph_programs_per_sm * (tile.small_num_warps or tile.num_warps) * 32
        assert tile.split_classes and (tile.small_max_registers is None or threads * tile.small_max_registers <= 65536)


def test_tile_config_refuses_an_unknown_fp8_conversion():
    from batchllm.attention_plan.tile_config import decode_tile_config

    with pytest.raises(ValueError, match="fp8_conversion must be one of"):
        replace(decode_tile_config(64, 3), fp8_conversion="bfloat16")


@pytest.mark.parametrize("backend_name", ["fused", "triton"])
def test_triton_backends_plan_decode_steps_with_the_cache_rows_tiles(backend_name):
    """The backend knows its cache's dtype: decode steps get the FP8 row on an FP8 cache, the
    bf16 row otherwise; steps with prefill chunks the prefill table of the cache's dtype."""
    from batchllm.attention_plan.tile_config import decode_tile_config, prefill_tile_config

    b = make_batch(MIXED, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16)
    for dtype, kv_fp8 in ((FP8, True), (torch.float32, False), (None, False)):
        backend = select_backend(backend_name, torch.device("cpu"), AttentionShape(16, 6, 2, 32, kv_cache_dtype=dtype)).backend
        assert backend.decode_tile == decode_tile_config(32, 3, kv_fp8=kv_fp8)
        decode = backend.build_plan(SimpleNamespace(**b.metadata_numpy(), decode_only=True))
        prefill = backend.build_plan(SimpleNamespace(**b.metadata_numpy(), decode_only=False))
        assert decode.tile == backend.decode_tile
        assert prefill.tile == prefill_tile_config(32, 3, kv_fp8=kv_fp8)


@pytest.mark.gpu
def test_fp8_prefill_table_on_a_mixed_step_gpu():
    """bf16 queries on the Llama-3.1-8B heads, a step with decode rows, a shared prefix's members,
    a prefix chunk and fresh prompts: the FP8 prefill table's two launches on two streams equal the
    reference on the same FP8 cache."""
    from batchllm.attention_plan.tile_config import prefill_tile_config

    seqs = ([SeqSpec(1, 150 + 13 * i) for i in range(300)] + [SeqSpec(128, 128) for _ in range(4)]
            + [SeqSpec(1, 2048 + 7 * i, 2048, 0) for i in range(16)] + [SeqSpec(600, 600, 0, 1, True)]
            + [SeqSpec(1, 2100 + 3 * i) for i in range(40)])
    b = make_batch(seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16,
                   device="cuda")
    k8, v8 = _fp8_caches(b)
    tile = prefill_tile_config(128, 4, interpret=False, kv_fp8=True)
    plan = _plan(b, (32, 8, 128), "cuda", groups=True, tile=tile)
    assert plan.work_big.shape[0] > 0 and plan.work_small.shape[0] > 0
    out = prefix_shared_attention(b.query, k8, v8, plan, 128 ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE,
                                  side_stream=torch.cuda.Stream())
    torch.testing.assert_close(out.float(), _reference(b, k8, v8, 128 ** -0.5, K_SCALE, V_SCALE), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_fp8_decode_rows_replayed_in_cuda_graphs_gpu():
    """bf16 queries on the Llama-3.1-8B heads: the step of the FP8 row and of the bf16 row on an FP8 cache,
    captured in a CUDA graph (BIG launch on a side stream) and replayed, equals the reference on
    the same cache; float16 MMAs round the probabilities to 11 bits, not 8, so their error is the
    smaller one."""
    candidates = _decode_rows(kv_fp8=True)
    seqs = [SeqSpec(1, 1000 + 37 * i) for i in range(40)] + [SeqSpec(1, 2048 + 7 * i, 2048, g)
                                                             for g in range(2) for i in range(16)]
    b = make_batch(seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16,
                   device="cuda")
    k8, v8 = _fp8_caches(b)
    scale = 128 ** -0.5
    ref = _reference(b, k8, v8, scale, K_SCALE, V_SCALE)
    side, errors = torch.cuda.Stream(), {}
    for name, tile in candidates.items():
        plan = _decode_plan(b, (32, 8, 128), "cuda", tile)
        out = capture_and_replay(lambda plan=plan: prefix_shared_attention(
            b.query, k8, v8, plan, scale, k_scale=K_SCALE, v_scale=V_SCALE, side_stream=side))
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2, msg=lambda m, name=name: f"{name}: {m}")
        errors.setdefault(tile.fp8_conversion == "query", []).append((out.float() - ref).pow(2).mean().sqrt().item())
    assert max(errors[False]) <= min(errors[True])  # float16 MMAs, either conversion, against bfloat16 ones
