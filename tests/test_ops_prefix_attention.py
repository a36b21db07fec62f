"""Fused prefix-shared attention against the references."""

import numpy as np
import pytest
import torch

from batchllm.attention_plan.work_list import build_prefix_shared_plan
from batchllm.ops.plan_device import device_num_sms, plan_to_device
from batchllm.ops.prefix_attention import prefix_shared_attention
from batchllm.ops.reference import paged_attention_reference
from op_references import prefix_shared_attention_reference
from synthetic_batch import SeqSpec, make_batch

P = 21  # prefix not a multiple of the block size
SCENARIOS = {
    # group 0 has no shared prefix at all (members with shared_kv_len 0)
    "empty_prefix": [SeqSpec(1, 9, 0, 0), SeqSpec(4, 20, 0, 0), SeqSpec(1, 33)],
    # a group's prefix chunk alone (second chunk of the prefix, positions 16..36)
    "prefix_only": [SeqSpec(21, 37, 0, 0, True)],
    # decode rows of two groups + ungrouped decodes, block-boundary seq lens (16, 32, 48)
    "decode_only": [SeqSpec(1, P + 1, P, 0), SeqSpec(1, P + 11, P, 0), SeqSpec(1, 48, P, 0),
                    SeqSpec(1, 33, 32, 1), SeqSpec(1, 64, 32, 1), SeqSpec(1, 16), SeqSpec(1, 45)],
    # distinct prefill chunks of members (first chunk and a later chunk), ungrouped prefill
    "prefill_only": [SeqSpec(9, P + 9, P, 0), SeqSpec(7, P + 30, P, 0), SeqSpec(16, 32)],
    # the prefix prefilled in the same step as its members' first distinct chunks
    "prefix_with_first_chunk": [SeqSpec(13, P, 0, 0, True), SeqSpec(6, P + 6, P, 0), SeqSpec(3, P + 3, P, 0),
                                SeqSpec(1, 17)],
    # ragged mix: prefix chunk + decodes + chunks over groups, an ungrouped seq still reading
    # shared blocks (shared_kv_len > 0 without a group), a zero-row seq
    "mixed_ragged": [SeqSpec(5, 16, 0, 3, True), SeqSpec(1, 40, 16, 4), SeqSpec(2, 18, 16, 4),
                     SeqSpec(0, 20, 16, 4), SeqSpec(1, 67, 16, 4), SeqSpec(11, 30, 0),
                     SeqSpec(1, 50, 17), SeqSpec(3, P + 5, P, 5), SeqSpec(1, P + 40, P, 5)],
}
HEADS = {"gqa3_d64": (9, 3, 64), "gqa4_d32": (8, 2, 32)}


def _run_case(seqs, heads, dtype, device, block_size=16, kv_split_tokens=16, order="cost", tile=None):
    num_heads, num_kv_heads, head_dim = heads
    b = make_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   block_size=block_size, dtype=dtype, device=device)
    plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=block_size, num_kv_heads=num_kv_heads,
                                    num_heads=num_heads, head_dim=head_dim, kv_split_tokens=kv_split_tokens,
                                    order=order, tile=tile, num_sms=device_num_sms(device))
    scale = head_dim ** -0.5
    out = prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan_to_device(plan, device), scale)
    args = (b.query.float(), b.k_cache.float(), b.v_cache.float(), b.query_start_loc, b.seq_lens,
            b.shared_kv_lens, b.block_tables)
    ref = prefix_shared_attention_reference(*args, b.group_ids, b.is_prefix, scale)
    ref_paged = paged_attention_reference(*args, scale)
    torch.testing.assert_close(ref, ref_paged, atol=1e-5, rtol=1e-5)  # the two oracles agree
    return out, ref


TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_matches_reference(device, scenario, dtype):
    out, ref = _run_case(SCENARIOS[scenario], HEADS["gqa3_d64"], dtype, device)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_fused_interleaved_order_matches_reference(device, scenario):
    out, ref = _run_case(SCENARIOS[scenario], HEADS["gqa3_d64"], torch.float16, device, order="interleave")
    torch.testing.assert_close(out.float(), ref, atol=TOL[torch.float16], rtol=TOL[torch.float16])


@pytest.mark.parametrize("block_size,kv_split_tokens", [(32, None), (16, 32)])
def test_fused_other_block_sizes_and_splits(device, block_size, kv_split_tokens):
    out, ref = _run_case(SCENARIOS["mixed_ragged"], HEADS["gqa4_d32"], torch.float16, device,
                         block_size=block_size, kv_split_tokens=kv_split_tokens)
    torch.testing.assert_close(out.float(), ref, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("scenario", ["prefix_only", "prefix_with_first_chunk", "mixed_ragged"])
def test_unmasked_and_masked_kv_steps_match(device, scenario):
    """The whole KV steps every row of a tile sees run unmasked, the rest masked: the result
    equals the reference on causal chunks, prefix-chunk row limits and ragged tails; BLOCK_N 32
    so that some tiles hold whole unmasked steps and a masked remainder."""
    from dataclasses import replace

    from batchllm.attention_plan.tile_config import default_tile_config

    tile = replace(default_tile_config(64, 3), small_n=32, big_n=32)
    out, ref = _run_case(SCENARIOS[scenario], HEADS["gqa3_d64"], torch.float32, device, tile=tile,
                         kv_split_tokens=None)
    torch.testing.assert_close(out.float(), ref, atol=2e-5, rtol=2e-5)


def _random_seqs(rng, max_groups=3):
    seqs = []
    for g in range(int(rng.integers(1, max_groups + 1))):
        p = int(rng.integers(0, 40))
        if p and rng.random() < 0.4:
            chunk = int(rng.integers(1, p + 1))
            seqs.append(SeqSpec(chunk, p, 0, g, True))
        for _ in range(int(rng.integers(1, 4))):
            d = int(rng.integers(1, 30))
            q = 1 if rng.random() < 0.6 else int(rng.integers(1, d + 1))
            seqs.append(SeqSpec(q, p + d, p, g))
    for _ in range(int(rng.integers(0, 3))):
        n = int(rng.integers(1, 50))
        seqs.append(SeqSpec(int(rng.integers(1, min(n, 8) + 1)), n))
    return seqs


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("order", ["cost", "interleave"])
def test_fused_random_batches(device, seed, order):
    seqs = _random_seqs(np.random.default_rng(seed))
    out, ref = _run_case(seqs, HEADS["gqa3_d64"], torch.float32, device, kv_split_tokens=[16, 32, None][seed],
                         order=order)
    torch.testing.assert_close(out.float(), ref, atol=2e-5, rtol=2e-5)


def test_rejects_mismatched_plan(device):
    b = make_batch(SCENARIOS["decode_only"], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, device=device)
    plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=3, num_heads=9, head_dim=64,
                                    kv_split_tokens=16)
    with pytest.raises(ValueError, match="rows"):
        prefix_shared_attention(b.query[:-1], b.k_cache, b.v_cache, plan_to_device(plan, device), 0.1)
    with pytest.raises(ValueError, match="dtypes"):
        prefix_shared_attention(b.query.half(), b.k_cache, b.v_cache, plan_to_device(plan, device), 0.1)


def _llama_seqs(rng):
    seqs = [SeqSpec(700, 2000, 0, 0, True)] + [SeqSpec(int(rng.integers(64, 300)), 2000 + 300, 2000, 0)]
    seqs += [SeqSpec(1, 2000 + int(rng.integers(1, 600)), 2000, 0) for _ in range(40)]
    for g in range(1, 5):
        seqs += [SeqSpec(1, 517 + int(rng.integers(1, 300)), 517, g) for _ in range(12)]
    seqs += [SeqSpec(1, int(rng.integers(100, 3000))) for _ in range(20)] + [SeqSpec(200, 1500)]
    return seqs


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["cost", "interleave"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_llama_shapes_gpu(order, dtype):
    seqs = _llama_seqs(np.random.default_rng(0))
    out, ref = _run_case(seqs, (32, 8, 128), dtype, "cuda", kv_split_tokens=None, order=order)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_fused_smollm_shapes_gpu(scenario):
    out, ref = _run_case(SCENARIOS[scenario], HEADS["gqa3_d64"], torch.bfloat16, "cuda", kv_split_tokens=None)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def _merge_case(seqs, heads, dtype, device, tile, kv_split_tokens):
    num_heads, num_kv_heads, head_dim = heads
    b = make_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                   dtype=dtype, device=device)
    plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=num_kv_heads,
                                    num_heads=num_heads, head_dim=head_dim, kv_split_tokens=kv_split_tokens,
                                    tile=tile)
    ref = paged_attention_reference(b.query.float(), b.k_cache.float(), b.v_cache.float(), b.query_start_loc,
                                    b.seq_lens, b.shared_kv_lens, b.block_tables, head_dim ** -0.5)
    return b, plan, ref


@pytest.mark.parametrize("scenario", ["decode_only", "prefix_with_first_chunk", "mixed_ragged"])
def test_merge_kernel_combines_partials(device, scenario):
    """Rows with several parts (prefix + distinct, split-KV pieces) merged by the merge kernel
    equal the reference."""
    b, plan, ref = _merge_case(SCENARIOS[scenario], HEADS["gqa3_d64"], torch.float32, device, None, 16)
    assert plan.merge_tokens.shape[0] > 0  # the case has rows to merge
    out = prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan_to_device(plan, device), 64 ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("scenario", ["decode_only", "mixed_ragged"])
def test_persistent_launch_runs_only_the_counted_items(device, scenario):
    """CUDA-graph launches are persistent: a fixed grid of programs strides over the first
    num_items items of a padded work list. Padding past the count must never run: here it is
    items that would write wrong results into the same rows and partial slots."""
    import dataclasses

    from batchllm.attention_plan.work_list import F_KV_END, F_KV_START

    b, plan, ref = _merge_case(SCENARIOS[scenario], HEADS["gqa3_d64"], torch.float32, device, None, 16)
    num_items = plan.work.shape[0]
    poison = plan.work.copy()
    poison[:, F_KV_END] = poison[:, F_KV_START] + 1  # one KV position instead of the item's range
    padded = torch.from_numpy(np.concatenate([plan.work, poison])).to(device)
    device_plan = plan_to_device(plan, device)
    results = []
    for count in (num_items, 2 * num_items):
        persistent = dataclasses.replace(device_plan, work=padded, persistent_programs=3,
                                         num_items=torch.tensor([count], dtype=torch.int32, device=device))
        results.append(prefix_shared_attention(b.query, b.k_cache, b.v_cache, persistent, 64 ** -0.5).float())
    torch.testing.assert_close(results[0], ref, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(results[1], ref, atol=1e-3)  # counting the padding would show


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_class_split_launches_match_reference(device, scenario):
    """tile.split_classes: BIG items, then SMALL items, each launch a class-specialised kernel
    variant with its own warps / stages; the same results as the single fused launch."""
    from dataclasses import replace

    from batchllm.attention_plan.tile_config import default_tile_config

    tile = replace(default_tile_config(64, 3), split_classes=True, small_num_warps=2, small_num_stages=1)
    b, plan, ref = _merge_case(SCENARIOS[scenario], HEADS["gqa3_d64"], torch.float32, device, tile, 16)
    device_plan = plan_to_device(plan, device)
    assert device_plan.work_big.shape[0] + device_plan.work_small.shape[0] == plan.work.shape[0]
    out = prefix_shared_attention(b.query, b.k_cache, b.v_cache, device_plan, 64 ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("scenario", ["prefix_with_first_chunk", "mixed_ragged"])
def test_persistent_class_split_launches_match_reference(device, scenario):
    """The CUDA-graph decode path: BIG and SMALL items in two padded lists, their counts on the
    device, one persistent class-specialised launch each."""
    from batchllm.attention_plan.tile_config import decode_tile_config

    tile = decode_tile_config(64, 3)
    assert tile.split_classes
    b, plan, ref = _merge_case(SCENARIOS[scenario], HEADS["gqa3_d64"], torch.float32, device, tile, 16)
    big, small = plan.class_lists()
    assert big.shape[0] > 0 and small.shape[0] > 0
    out = prefix_shared_attention(b.query, b.k_cache, b.v_cache, _persistent_split_plan(plan, device), 64 ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-5, rtol=2e-5)


def _persistent_split_plan(plan, device):
    """The plan's BIG and SMALL lists padded with items that would corrupt rows if they ran, their
    counts on the device ([BIG, SMALL, SMALL not packed]), persistent launches of 2 programs."""
    import dataclasses

    from batchllm.attention_plan.work_list import F_KV_END, F_KV_START

    padded = []
    for items in plan.class_lists():
        poison = items.copy()
        poison[:, F_KV_END] = poison[:, F_KV_START] + 1  # one KV position instead of the item's range
        padded.append(torch.from_numpy(np.concatenate([items, poison, poison])).to(device))
    return dataclasses.replace(plan_to_device(plan, device), work_big=padded[0], work_small=padded[1],
                               num_items=torch.from_numpy(plan.item_counts()).to(device), persistent_programs=2)


@pytest.mark.gpu
def test_overlapped_class_split_launches_match_serial_inside_a_cuda_graph():
    """The engine's decode path: the BIG launch on a side stream, concurrent with the SMALL one,
    captured into a CUDA graph. The launches write disjoint rows and partial slots, so the
    replayed output equals the serial launches' bit for bit."""
    from batchllm.attention_plan.tile_config import decode_tile_config

    rng = np.random.default_rng(3)
    seqs = [SeqSpec(1, 2048 + int(rng.integers(1, 300)), 2048, g) for g in range(4) for _ in range(16)]
    seqs += [SeqSpec(1, int(rng.integers(100, 3000))) for _ in range(8)]
    num_heads, num_kv_heads, head_dim = 32, 8, 128
    b = make_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                   dtype=torch.bfloat16, device="cuda")
    tile = decode_tile_config(head_dim, num_heads // num_kv_heads)
    plan = plan_to_device(build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=num_kv_heads,
                                                   num_heads=num_heads, head_dim=head_dim, tile=tile,
                                                   num_sms=device_num_sms("cuda")), "cuda")
    assert plan.work_big.shape[0] > 0 and plan.work_small.shape[0] > 0
    scale = head_dim ** -0.5
    serial = prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan, scale)
    side = torch.cuda.Stream()
    eager = prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan, scale, side_stream=side)
    graph = torch.cuda.CUDAGraph()
    capture_stream = torch.cuda.Stream()
    capture_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture_stream):
        prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan, scale, side_stream=side)  # warm
        with torch.cuda.graph(graph, stream=capture_stream):
            captured = prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan, scale, side_stream=side)
    torch.cuda.current_stream().wait_stream(capture_stream)
    captured.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, serial)
    assert torch.equal(captured, serial)
    ref = paged_attention_reference(b.query.float(), b.k_cache.float(), b.v_cache.float(), b.query_start_loc,
                                    b.seq_lens, b.shared_kv_lens, b.block_tables, scale)
    torch.testing.assert_close(serial.float(), ref, atol=2e-2, rtol=2e-2)


def _dense_tile(min_rows=2, min_tokens=8):
    from dataclasses import replace

    from batchllm.attention_plan.tile_config import default_tile_config

    return replace(default_tile_config(64, 3), dense_min_rows=min_rows, dense_min_tokens=min_tokens)


@pytest.mark.parametrize("scenario", ["prefill_only", "prefix_with_first_chunk", "mixed_ragged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_calls_match_reference(device, scenario, dtype):
    """The KV every row of a segment sees, run as dense calls (gathered blocks, outputs and
    log-sum-exps merged with the rows' other parts), gives the reference's attention."""
    b, plan, ref = _merge_case(SCENARIOS[scenario], HEADS["gqa3_d64"], dtype, device, _dense_tile(), 16)
    assert plan.dense.shape[0] > 0 and plan.dense[:, 7].any()  # unmasked and causal calls
    out = prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan_to_device(plan, device), 64 ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("seed", range(4))
def test_dense_calls_random_batches_match_without(device, seed):
    """Random steps: a plan with dense calls and one without give the same attention."""
    from dataclasses import replace

    seqs = _random_seqs(np.random.default_rng(seed), max_groups=4) + [SeqSpec(9, 70), SeqSpec(12, 33, 17)]
    tile = _dense_tile()
    b, plan, ref = _merge_case(seqs, HEADS["gqa3_d64"], torch.float32, device, tile, 16)
    assert plan.dense.shape[0] > 0
    without = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=3, num_heads=9, head_dim=64,
                                       kv_split_tokens=16, tile=replace(tile, dense_min_rows=0))
    scale = 64 ** -0.5
    out = prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan_to_device(plan, device), scale)
    torch.testing.assert_close(out, prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan_to_device(without, device), scale),
                               atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.float(), ref, atol=2e-5, rtol=2e-5)


def _random_steps_with_squares(rng):
    """Groups (with or without their prefix chunk), runs of equal causal squares (fresh prompts or
    later chunks) and single prompts, as blocks in random order, each group's seqs together."""
    blocks = []
    for g in range(int(rng.integers(0, 3))):
        p = int(rng.integers(1, 60))
        block = [SeqSpec(int(rng.integers(1, p + 1)), p, 0, g, True)] if rng.random() < 0.5 else []
        for _ in range(int(rng.integers(1, 4))):
            d = int(rng.integers(1, 30))
            block.append(SeqSpec(1 if rng.random() < 0.5 else int(rng.integers(1, d + 1)), p + d, p, g))
        blocks.append(block)
    for _ in range(int(rng.integers(0, 3))):
        n, start = int(rng.integers(2, 24)), 0 if rng.random() < 0.5 else int(rng.integers(1, 40))
        blocks.append([SeqSpec(n, start + n)] * int(rng.integers(1, 5)))
    for _ in range(int(rng.integers(0, 3))):
        n = int(rng.integers(1, 60))
        blocks.append([SeqSpec(int(rng.integers(1, n + 1)), n)])
    blocks = blocks or [[SeqSpec(6, 6)] * 3]
    return [seq for i in rng.permutation(len(blocks)) for seq in blocks[i]]


@pytest.mark.parametrize("seed", range(8))
def test_dense_calls_random_steps_with_squares_match_reference(device, seed):
    """Random steps and random dense thresholds (unmasked calls, causal squares, batched squares
    and whole-step calls alike) give the reference's attention."""
    from dataclasses import replace

    rng = np.random.default_rng(100 + seed)
    seqs = _random_steps_with_squares(rng)
    tile = replace(_dense_tile(min_rows=int(rng.integers(1, 8)), min_tokens=int(rng.integers(1, 24))),
                   dense_causal_min_rows=int(rng.integers(0, 30)))
    b, plan, ref = _merge_case(seqs, HEADS["gqa3_d64"], torch.float32, device, tile, [16, 32][seed % 2])
    out = prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan_to_device(plan, device), 64 ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batched_causal_calls_match_reference(device, dtype):
    """Equal causal squares on consecutive rows run as batched calls: three fresh 6-token prompts
    (a batch whose rows have no other part, written to the output) and three later 6-row chunks
    at positions 16-21 (a batch written to partial slots, merged with their context's calls),
    beside a group with a prefix chunk and a decode row. Equal to the reference."""
    from dataclasses import replace

    seqs = [SeqSpec(6, 6)] * 3 + [SeqSpec(6, 22)] * 3 + [SeqSpec(5, 40, 0, 0, True), SeqSpec(1, 44, 40, 0)]
    tile = replace(_dense_tile(min_rows=4, min_tokens=8), dense_causal_min_rows=12)
    b, plan, ref = _merge_case(seqs, HEADS["gqa3_d64"], dtype, device, tile, 16)
    causal = plan.dense[plan.dense[:, 7] == 1]
    assert causal[:, 8].tolist() == [3, 0, 0, 3, 0, 0]  # two batches of three
    assert causal[:3, 6].tolist() == [-1] * 3 and causal[3:, 6].tolist() == [causal[3, 6] + 6 * i for i in range(3)]
    out = prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan_to_device(plan, device), 64 ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_calls_padded_to_their_sizes_match_reference(device, dtype):
    """The library kernel sees rows padded up to the dense calls' sizes: three fresh 9-row prompts
    (a batch of squares padded to 10 rows with zero rows and KV), an 11-row prompt (padded to 12 by
    the query's next rows), and, last in the step, a 9-row chunk at positions 40-48 (its 40-position
    context and its square padded with zero rows). Equal to the reference; so is the step of the
    three prompts alone, one padded call whose output is the step's."""
    from dataclasses import replace

    from batchllm.attention_plan.dense_calls import dense_rows_padded
    from batchllm.ops.prefix_attention import whole_step_call

    seqs = [SeqSpec(9, 9)] * 3 + [SeqSpec(11, 11), SeqSpec(1, 30), SeqSpec(9, 49)]
    tile = replace(_dense_tile(min_rows=4, min_tokens=8), dense_causal_min_rows=9)
    b, plan, ref = _merge_case(seqs, HEADS["gqa3_d64"], dtype, device, tile, 16)
    calls = [(c.q_start, c.q_count, c.batch, c.kv_len, c.causal) for c in plan_to_device(plan, device).dense]
    assert calls == [(39, 9, 1, 40, False), (0, 27, 3, 9, True), (27, 11, 1, 11, True), (39, 9, 1, 9, True)]
    assert [dense_rows_padded(rows // batch) for _, rows, batch, _, _ in calls] == [10, 10, 12, 10]
    assert b.query.shape[0] == 48  # the last chunk's padded rows run past the query: zero rows
    out = prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan_to_device(plan, device), 64 ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    # the three prompts alone: one padded call whose output is the step's
    b, plan, ref = _merge_case(seqs[:3], HEADS["gqa3_d64"], dtype, device, tile, 16)
    device_plan = plan_to_device(plan, device)
    assert whole_step_call(device_plan) is not None and plan.work.shape[0] == 0
    out = prefix_shared_attention(b.query, b.k_cache, b.v_cache, device_plan, 64 ** -0.5)
    assert out.shape == b.query.shape
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_step_of_fresh_prompts_is_one_call_whose_output_is_the_steps(device, dtype):
    """Four fresh 6-token prompts and nothing else: one batched causal call computes every row,
    so its output is the step's (no tiles, no merge); with a decode row beside them it is not."""
    from dataclasses import replace

    from batchllm.ops.prefix_attention import whole_step_call

    tile = replace(_dense_tile(min_rows=4, min_tokens=8), dense_causal_min_rows=12)
    b, plan, ref = _merge_case([SeqSpec(6, 6)] * 4, HEADS["gqa3_d64"], dtype, device, tile, 16)
    device_plan = plan_to_device(plan, device)
    call = whole_step_call(device_plan)
    assert (call.q_start, call.q_count, call.batch, call.causal, call.partial_base) == (0, 24, 4, True, -1)
    assert plan.work.shape[0] == 0 and plan.merge_tokens.shape[0] == 0
    out = prefix_shared_attention(b.query, b.k_cache, b.v_cache, device_plan, 64 ** -0.5)
    assert out.shape == b.query.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    _, mixed, _ = _merge_case([SeqSpec(6, 6)] * 4 + [SeqSpec(1, 30)], HEADS["gqa3_d64"], dtype, device, tile, 16)
    mixed = plan_to_device(mixed, device)
    assert len(mixed.dense) == 1 and mixed.dense[0].batch == 4 and whole_step_call(mixed) is None


def test_dense_call_writes_rows_that_have_no_other_part(device):
    """A dense call whose rows have no partial slot writes the output rows themselves."""
    import dataclasses

    from batchllm.ops.dense_attention import dense_attention_lse
    from batchllm.ops.prefix_attention import run_dense_calls

    b, plan, _ = _merge_case(SCENARIOS["prefill_only"], HEADS["gqa3_d64"], torch.float32, device, _dense_tile(), 16)
    q_start, rows, seq, first_block, offset, kv_len, _, causal, _ = (int(x) for x in plan.dense[0])
    assert not causal
    only_part = plan.dense[:1].copy()
    only_part[0, 6] = -1  # no partial slot
    device_plan = plan_to_device(dataclasses.replace(plan, dense=only_part), device)
    out = torch.zeros_like(b.query)
    untouched = torch.full((1, 9, 64), 7.0)
    run_dense_calls(device_plan, b.query, b.k_cache, b.v_cache, out, untouched, untouched, 64 ** -0.5)
    positions = torch.arange(offset, offset + kv_len)
    blocks = b.block_tables[seq, first_block + positions // 16].long()
    key, value = b.k_cache[blocks, positions % 16], b.v_cache[blocks, positions % 16]
    expected, _ = dense_attention_lse(b.query[q_start:q_start + rows], key, value, 64 ** -0.5)
    torch.testing.assert_close(out[q_start:q_start + rows], expected, atol=1e-6, rtol=1e-6)
    assert not out[:q_start].any() and not out[q_start + rows:].any() and (untouched == 7.0).all()


def test_dense_attention_reference_log_sum_exp():
    """The CPU path of the dense call: softmax output and natural log-sum-exp per row and head,
    with grouped-query heads."""
    from batchllm.ops.dense_attention import dense_attention_lse

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 6, 16, generator=g), torch.randn(9, 2, 16, generator=g), torch.randn(9, 2, 16, generator=g)
    out, lse = dense_attention_lse(q, k, v, 0.25)
    for head in range(6):
        scores = q[:, head] @ k[:, head // 3].T * 0.25
        torch.testing.assert_close(lse[:, head], torch.logsumexp(scores, -1))
        torch.testing.assert_close(out[:, head], torch.softmax(scores, -1) @ v[:, head // 3])


def test_dense_attention_reference_causal():
    """A causal dense call: row i attends to keys 0..i only; rows and keys must match."""
    from batchllm.ops.dense_attention import dense_attention_lse

    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(6, 4, 16, generator=g), torch.randn(6, 2, 16, generator=g), torch.randn(6, 2, 16, generator=g)
    out, lse = dense_attention_lse(q, k, v, 0.25, causal=True)
    for row in range(6):
        part_out, part_lse = dense_attention_lse(q[row:row + 1], k[:row + 1], v[:row + 1], 0.25)
        torch.testing.assert_close(out[row], part_out[0])
        torch.testing.assert_close(lse[row], part_lse[0])
    with pytest.raises(ValueError, match="as many rows as keys"):
        dense_attention_lse(q, k[:5], v[:5], 0.25, causal=True)


def test_dense_plan_refuses_a_sliding_window(device):
    b, plan, _ = _merge_case(SCENARIOS["prefill_only"], HEADS["gqa3_d64"], torch.float32, device, _dense_tile(), 16)
    with pytest.raises(ValueError, match="sliding-window"):
        prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan_to_device(plan, device), 0.1, sliding_window=8,
                                positions=torch.zeros(b.query.shape[0], dtype=torch.int64, device=device))


def _llama_case_gpu(seqs, kv_fp8: bool):
    """bf16 Llama-3.1-8B heads (32 / 8, head_dim 128) on the GPU: the batch, its query as a strided
    view of a fused qkv buffer (as the model passes it), and its caches in bf16 or
    float8_e4m3fn with their scales."""
    num_heads, num_kv_heads, head_dim = 32, 8, 128
    b = make_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                   dtype=torch.bfloat16, device="cuda")
    qkv = torch.randn(b.query.shape[0], (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.bfloat16,
                      device="cuda")
    query = qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)
    query.copy_(b.query)
    if not kv_fp8:
        return b, query, b.k_cache, b.v_cache, 1.0, 1.0
    k_scale, v_scale = float(b.k_cache.abs().max()) / 448, float(b.v_cache.abs().max()) / 448
    return (b, query, (b.k_cache.float() / k_scale).to(torch.float8_e4m3fn),
            (b.v_cache.float() / v_scale).to(torch.float8_e4m3fn), k_scale, v_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_fp8", [False, True])
def test_dense_calls_on_cudnn_gpu(kv_fp8):
    """bf16 Llama heads on the engine's prefill table (dense calls from 512 rows), and with causal
    squares from 512 rows: a group's prefix chunk, its prefix seen by its members' chunks and
    decode rows, and a long unshared prompt's later chunk, with the query a strided view of a
    fused qkv buffer as the model passes it, and a bf16 or float8_e4m3fn cache. Equal to the plan
    without dense calls and to the reference."""
    from dataclasses import replace

    from batchllm.ops.dense_attention import uses_cudnn
    from batchllm.attention_plan.tile_config import default_tile_config

    seqs = [SeqSpec(512, 2048, 0, 0, True), SeqSpec(200, 2048 + 200, 2048, 0), SeqSpec(300, 2048 + 300, 2048, 0)]
    seqs += [SeqSpec(1, 2048 + 40, 2048, 0) for _ in range(16)] + [SeqSpec(640, 3000)] + [SeqSpec(1, 900)]
    num_heads, num_kv_heads, head_dim = 32, 8, 128
    b, query, k_cache, v_cache, k_scale, v_scale = _llama_case_gpu(seqs, kv_fp8)
    assert uses_cudnn(query, query)
    tile = default_tile_config(head_dim, num_heads // num_kv_heads)
    assert (tile.dense_min_rows, tile.dense_min_tokens, tile.causal_square_rows()) == (512, 1024, 4096)
    # (KV positions, causal) of each call, in row order
    expected = {
        # the engine's table: the members' 516 rows reach 512, so the prefix chunk leaves its group:
        # its rows x its first 1536 positions, the members' rows x the whole prefix, the long
        # prompt's chunk x its first 2361 positions, cut down to the dense calls' sizes
        # (dense_size_step: 2048)
        "table": (tile, [[1536, 0], [2048, 0], [2048, 0]]),
        # causal squares from 512 rows: the prefix chunk leaves its group (its first 1536 positions,
        # then its own 512, causal), the members' 516 rows see the whole prefix, the long prompt's
        # chunk sees its first 2360 positions (cut to 2048), then its own 640, causal (unmasked
        # calls first; 640 rows pad to 640)
        "squares": (replace(tile, dense_causal_min_rows=512), [[1536, 0], [2048, 0], [2048, 0], [512, 1], [640, 1]]),
        "tiles only": (replace(tile, dense_min_rows=0), []),
    }
    outs = []
    for config, calls in expected.values():
        plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=num_kv_heads,
                                        num_heads=num_heads, head_dim=head_dim, tile=config,
                                        num_sms=device_num_sms("cuda"))
        assert plan.dense[:, [5, 7]].tolist() == calls
        outs.append(prefix_shared_attention(query, k_cache, v_cache, plan_to_device(plan, "cuda"), head_dim ** -0.5,
                                            k_scale=k_scale, v_scale=v_scale).float())
    ref = paged_attention_reference(b.query.float(), k_cache.float() * k_scale, v_cache.float() * v_scale,
                                    b.query_start_loc, b.seq_lens, b.shared_kv_lens, b.block_tables, head_dim ** -0.5)
    for out in outs:
        torch.testing.assert_close(out, outs[-1], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_fp8", [False, True])
def test_batched_causal_calls_on_cudnn_gpu(kv_fp8):
    """bf16 Llama heads, causal calls from 1024 rows in all: three fresh 640-token prompts run as
    one batched call written to the output, two 640-row chunks at positions 1360-1999 as one
    batched call written to partial slots (beside their contexts' unmasked calls), with a decode
    row, the query a strided view of a fused qkv buffer, and a bf16 or float8_e4m3fn cache.
    Equal to the plan without dense calls and to the reference."""
    from dataclasses import replace

    from batchllm.attention_plan.tile_config import default_tile_config

    seqs = [SeqSpec(640, 640)] * 3 + [SeqSpec(640, 2000)] * 2 + [SeqSpec(1, 900)]
    num_heads, num_kv_heads, head_dim = 32, 8, 128
    b, query, k_cache, v_cache, k_scale, v_scale = _llama_case_gpu(seqs, kv_fp8)
    tile = replace(default_tile_config(head_dim, num_heads // num_kv_heads), dense_causal_min_rows=1024)
    outs = []
    for config in (tile, replace(tile, dense_min_rows=0)):
        plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=num_kv_heads,
                                        num_heads=num_heads, head_dim=head_dim, tile=config,
                                        num_sms=device_num_sms("cuda"))
        device_plan = plan_to_device(plan, "cuda")
        if config.dense_min_rows:
            assert [(c.q_count, c.batch, c.causal, c.partial_base < 0) for c in device_plan.dense] == [
                (640, 1, False, False), (640, 1, False, False), (1920, 3, True, True), (1280, 2, True, False)]
        outs.append(prefix_shared_attention(query, k_cache, v_cache, device_plan, head_dim ** -0.5,
                                            k_scale=k_scale, v_scale=v_scale).float())
    ref = paged_attention_reference(b.query.float(), k_cache.float() * k_scale, v_cache.float() * v_scale,
                                    b.query_start_loc, b.seq_lens, b.shared_kv_lens, b.block_tables, head_dim ** -0.5)
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs[0], ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_a_step_of_fresh_prompts_on_cudnn_gpu():
    """bf16 Llama heads, four fresh 1024-token prompts: one batched causal call on cuDNN computes
    the whole step, and its output, returned without a copy, has the query's layout and equals
    the tiles' and the reference."""
    from dataclasses import replace

    from batchllm.attention_plan.tile_config import default_tile_config
    from batchllm.ops.prefix_attention import whole_step_call

    num_heads, num_kv_heads, head_dim = 32, 8, 128
    b, query, k_cache, v_cache, _, _ = _llama_case_gpu([SeqSpec(1024, 1024)] * 4, kv_fp8=False)
    tile = default_tile_config(head_dim, num_heads // num_kv_heads)
    outs = []
    for config in (tile, replace(tile, dense_min_rows=0)):
        plan = plan_to_device(build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=num_kv_heads,
                                                       num_heads=num_heads, head_dim=head_dim, tile=config,
                                                       num_sms=device_num_sms("cuda")), "cuda")
        assert (whole_step_call(plan) is not None) == bool(config.dense_min_rows)
        outs.append(prefix_shared_attention(query, k_cache, v_cache, plan, head_dim ** -0.5))
    assert outs[0].is_contiguous() and outs[0].dtype == torch.bfloat16
    ref = paged_attention_reference(b.query.float(), k_cache.float(), v_cache.float(), b.query_start_loc,
                                    b.seq_lens, b.shared_kv_lens, b.block_tables, head_dim ** -0.5)
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs[0].float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("case", ["mixed_ragged", "prefill_only", "fresh_prompts"])
def test_output_written_into_a_given_tensor(device, case):
    """out=: the attention lands in the given tensor (a piecewise graph's static buffer), the same
    values as a fresh output: with tiles, dense calls and merges, or one whole-step dense call
    (four fresh prompts), whose output is copied there."""
    from dataclasses import replace

    from batchllm.ops.prefix_attention import whole_step_call

    if case == "fresh_prompts":
        tile = replace(_dense_tile(min_rows=4, min_tokens=8), dense_causal_min_rows=12)
        b, plan, ref = _merge_case([SeqSpec(6, 6)] * 4, HEADS["gqa3_d64"], torch.float32, device, tile, 16)
    else:
        b, plan, ref = _merge_case(SCENARIOS[case], HEADS["gqa3_d64"], torch.float32, device, _dense_tile(), 16)
    device_plan = plan_to_device(plan, device)
    assert (whole_step_call(device_plan) is not None) == (case == "fresh_prompts")
    expected = prefix_shared_attention(b.query, b.k_cache, b.v_cache, device_plan, 64 ** -0.5)
    out = torch.full_like(b.query, float("nan"))
    assert prefix_shared_attention(b.query, b.k_cache, b.v_cache, device_plan, 64 ** -0.5, out=out) is out
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="shaped like query"):
        prefix_shared_attention(b.query, b.k_cache, b.v_cache, device_plan, 64 ** -0.5, out=out[:, :1])


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("pack,persistent,max_positions", [(2, False, 512), (4, True, 512), (4, False, 20),
                                                           (4, True, 20)])
def test_packed_small_launch_matches_reference(device, scenario, pack, persistent, max_positions):
    """tile.small_pack: the SMALL launch runs its one-row items `pack` to a program under a
    block-diagonal mask (GQA 3 in slots of 16 // pack rows, a padding row in each with pack 4),
    but those over max_positions KV positions (first in the list) one to a program; segments of
    several rows go to the BIG launch; the results are the reference's, persistent (padded
    lists, counts on the device) or not."""
    import dataclasses

    from batchllm.attention_plan.tile_config import decode_tile_config
    from batchllm.attention_plan.work_list import F_KV_END, F_KV_START, F_MASK_MODE, F_Q_COUNT, MASK_NONE

    tile = dataclasses.replace(decode_tile_config(64, 3), small_pack=pack, small_n=16 * pack,
                               small_pack_max_positions=max_positions)
    b, plan, ref = _merge_case(SCENARIOS[scenario], HEADS["gqa3_d64"], torch.float32, device, tile, 64)
    _, small = plan.class_lists()
    assert (small[:, F_Q_COUNT] == 1).all() and (small[:, F_MASK_MODE] == MASK_NONE).all()
    kv_len = small[:, F_KV_END] - small[:, F_KV_START]
    num_unpacked = int(plan.item_counts()[2])
    assert (kv_len[:num_unpacked] > max_positions).all() and (kv_len[num_unpacked:] <= max_positions).all()
    device_plan = _persistent_split_plan(plan, device) if persistent else plan_to_device(plan, device)
    out = prefix_shared_attention(b.query, b.k_cache, b.v_cache, device_plan, 64 ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-5, rtol=2e-5)


def test_packed_small_launch_on_an_fp8_cache_matches_unpacked(device):
    """The packed SMALL launch on a float8_e4m3fn cache (float16 MMAs, the K and V scales) gives
    the unpacked launch's output."""
    import dataclasses

    from batchllm.attention_plan.tile_config import decode_tile_config

    seqs = SCENARIOS["decode_only"] + SCENARIOS["mixed_ragged"]
    b = make_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float16, device=device)
    k8, v8 = (c.to(torch.float8_e4m3fn) for c in (b.k_cache, b.v_cache))
    outs = []
    for pack in (1, 4):
        tile = dataclasses.replace(decode_tile_config(32, 4, kv_fp8=True), small_pack=pack, small_n=16 * pack)
        plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=2, num_heads=8, head_dim=32,
                                        kv_split_tokens=32, tile=tile, num_sms=device_num_sms(device))
        outs.append(prefix_shared_attention(b.query, k8, v8, plan_to_device(plan, device), 32 ** -0.5,
                                            k_scale=0.5, v_scale=2.0).float())
    torch.testing.assert_close(outs[1], outs[0], atol=3e-3, rtol=3e-3)


def test_small_pack_must_fit_the_query_heads(device):
    from batchllm.attention_plan.tile_config import TileConfig, decode_tile_config
    import dataclasses

    for pack, split in ((4, False), (3, True)):  # no split classes; not a power of 2
        with pytest.raises(ValueError, match="small_pack"):
            TileConfig(small_m=16, small_n=48, big_m=32, big_n=16, num_warps=4, num_stages=1, min_kv_split_tokens=16,
                       split_classes=split, small_pack=pack)
    tile = dataclasses.replace(decode_tile_config(64, 3), small_pack=8, small_n=128)  # 16 rows hold 5 items of 3 heads
    b = make_batch(SCENARIOS["decode_only"], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                   dtype=torch.float32, device=device)
    plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=3, num_heads=9, head_dim=64,
                                    kv_split_tokens=16, tile=tile, num_sms=device_num_sms(device))
    with pytest.raises(ValueError, match="small_pack 8"):
        prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan_to_device(plan, device), 0.125)


def test_which_launches_pack_their_items(device):
    """Only SMALL launches pack, never with a sliding window; an eager (not persistent) launch packs
    only when none of its items is over small_pack_max_positions, a persistent one always (it runs
    those first items one to a program)."""
    import dataclasses

    from batchllm.attention_plan.tile_config import decode_tile_config
    from batchllm.ops.prefix_attention import small_pack

    for max_positions, eager_pack in ((20, 1), (512, 4)):
        tile = dataclasses.replace(decode_tile_config(64, 3), small_pack=4, small_n=64,
                                   small_pack_max_positions=max_positions)
        b, plan, ref = _merge_case(SCENARIOS["decode_only"], HEADS["gqa3_d64"], torch.float32, device, tile, 64)
        device_plan = plan_to_device(plan, device)
        assert device_plan.num_unpacked_small == plan.item_counts()[2] == (3 if max_positions == 20 else 0)
        assert small_pack(device_plan, 1, None, persistent=False) == eager_pack
        assert small_pack(device_plan, 1, None, persistent=True) == 4
        assert small_pack(device_plan, 2, None, persistent=True) == small_pack(device_plan, 1, 8, persistent=True) == 1
