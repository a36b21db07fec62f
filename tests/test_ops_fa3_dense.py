"""Dense calls on FA3's FP8 prefill (ops/fa3_dense.py): their ragged batches on the host, the seam
through which prefix_shared_attention hands them over, the backend's wiring, and on a Hopper GPU
with FlashInfer the kernel's outputs against the reference."""

import importlib.util
from dataclasses import replace

import numpy as np
import pytest
import torch

from batchllm.attention_plan.tile_config import default_tile_config
from batchllm.attention_plan.work_list import build_prefix_shared_plan
from batchllm.engine.attention.triton_backend import TritonBackend
from batchllm.engine.step_inputs import build_step_inputs
from batchllm.ops.fa3_dense import ragged_batches
from batchllm.ops.plan_device import DenseCall, device_num_sms, plan_to_device
from batchllm.ops.prefix_attention import prefix_shared_attention, run_dense_calls
from batchllm.ops.reference import paged_attention_reference
from batchllm.sched.interface import ScheduledChunk, SchedulerOutput
from synthetic_batch import SeqSpec, make_batch


def test_ragged_batches_of_a_steps_calls():
    """Unmasked calls first, then the causal squares, a batched call's squares one entry each;
    the rows each batch reads follow one another in call order (a row may be in both)."""
    blocks = torch.zeros(4, dtype=torch.int32)
    calls = (DenseCall(10, 6, blocks, 3, 40, 0), DenseCall(40, 8, blocks, 0, 4, 6, causal=True, batch=2),
             DenseCall(0, 5, blocks, 0, 5, -1, causal=True), DenseCall(16, 3, blocks, 0, 17, -1))
    batches, rows = ragged_batches(calls)
    assert [(b.causal, b.qo_lens, b.kv_lens, b.row_offset) for b in batches] == [
        (False, (6, 3), (40, 17), 0), (True, (4, 4, 5), (4, 4, 5), 9)]
    assert [b.calls for b in batches] == [(calls[0], calls[3]), (calls[1], calls[2])]
    assert rows.dtype == np.int32 and rows.tolist() == [
        *range(10, 16), 16, 17, 18, *range(40, 48), *range(0, 5)]
    assert [b.num_rows for b in batches] == [9, 13] and [b.num_kv for b in batches] == [57, 13]
    assert ragged_batches(calls[2:3])[0][0].row_offset == 0  # causal only: one batch


class _LibraryRunner:
    """A dense-call runner that runs the library path itself, recording its calls."""

    def __init__(self, plan):
        self.plan, self.calls = plan, 0

    def __call__(self, query, k_cache, v_cache, out, part_out, part_lse, scale, k_scale=1.0, v_scale=1.0):
        self.calls += 1
        run_dense_calls(self.plan, query, k_cache, v_cache, out, part_out, part_lse, scale, k_scale, v_scale)


@pytest.mark.parametrize("whole_step", [False, True])
def test_prefix_attention_hands_dense_calls_to_the_plans_runner(device, whole_step):
    """With a runner on the plan, the dense calls are its (once per layer), also where one call
    would have made up the whole step, and the output is the library path's."""
    seqs = [SeqSpec(24, 24)] if whole_step else [SeqSpec(12, 40), SeqSpec(1, 30), SeqSpec(9, 9)]
    b = make_batch(seqs, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, device=device)
    tile = replace(default_tile_config(32, 3), dense_min_rows=8, dense_min_tokens=8, dense_causal_min_rows=8)
    plan = plan_to_device(build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=2, num_heads=6,
                                                   head_dim=32, tile=tile, kv_split_tokens=16), device)
    assert plan.dense
    expected = prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan, 0.2)
    plan.dense_runner = runner = _LibraryRunner(plan)
    out = prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan, 0.2)
    assert runner.calls == 1
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


class _FakeFa3:
    def __init__(self):
        self.prepared = []

    def prepare(self, calls, upload=None):
        self.prepared.append(calls)
        return "runner"


def test_backend_with_fa3_plans_causal_calls_from_the_least_rows_at_any_size():
    """A backend given FA3's prefill: causal calls from dense_min_rows holding their chunks' whole
    context, calls of any size, each step with dense calls prepared once and its runner on the
    plan; steps without keep none."""
    fa3 = _FakeFa3()
    backend = TritonBackend(16, 8, 2, 64, torch.device("cpu"), True, fa3_dense=fa3)
    plain = TritonBackend(16, 8, 2, 64, torch.device("cpu"), True)
    assert backend.prefill_tile == replace(plain.prefill_tile, dense_any_size=True, dense_causal_whole=True,
                                           dense_causal_min_rows=plain.prefill_tile.dense_min_rows)
    backend.prefill_tile = replace(backend.prefill_tile, dense_min_rows=8, dense_min_tokens=8, dense_causal_min_rows=8)
    chunks = (ScheduledChunk(seq_id=0, token_ids=tuple(range(30)), start_position=0, num_tokens=30,
                             new_block_ids=(0, 1), sample=True),)
    inputs = build_step_inputs(SchedulerOutput(0, chunks), 16)
    on_device = backend.plan_to_device(backend.build_plan(inputs), torch.device("cpu"))
    assert on_device.dense_runner == "runner" and fa3.prepared == [on_device.dense]
    assert [(c.q_count, c.kv_len, c.causal) for c in on_device.dense] == [(30, 30, True)]
    decode = (ScheduledChunk(seq_id=0, token_ids=(), start_position=30, num_tokens=1, new_block_ids=(0, 1), sample=True,
                             is_decode=True),)
    plan = backend.plan_to_device(backend.build_plan(build_step_inputs(SchedulerOutput(1, decode), 16)),
                                  torch.device("cpu"))
    assert plan.dense_runner is None and len(fa3.prepared) == 1


def _fa3_ready() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and importlib.util.find_spec("flashinfer") is not None)


@pytest.mark.gpu
@pytest.mark.skipif(not _fa3_ready(), reason="FA3 runs on a Hopper GPU with FlashInfer installed")
@pytest.mark.parametrize("whole", [False, True])
def test_fa3_dense_calls_on_the_gpu(whole):
    """bf16 Llama heads on an FP8 cache, the engine's FA3 table (causal squares from 512 rows, any
    size): a group's prefix chunk, its members' chunks and decode rows, a long prompt's later chunk
    and a fresh prompt, the query a strided view of a fused qkv buffer. FP8 products put the
    output within 10% (mean absolute error over mean magnitude) of the reference; the same plan on
    cuDNN lands within 1%."""
    from batchllm.ops.fa3_dense import Fa3Dense

    num_heads, num_kv_heads, head_dim = 32, 8, 128
    seqs = [SeqSpec(512, 2048, 0, 0, True), SeqSpec(200, 2048 + 200, 2048, 0), SeqSpec(300, 2048 + 300, 2048, 0)]
    seqs += [SeqSpec(1, 2048 + 40, 2048, 0) for _ in range(16)] + [SeqSpec(640, 3000), SeqSpec(1, 900),
                                                                   SeqSpec(700, 700)]
    b = make_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                   dtype=torch.bfloat16, device="cuda")
    qkv = torch.randn(b.query.shape[0], (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.bfloat16, device="cuda")
    query = qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)
    query.copy_(b.query * 4)  # logits of a few units: attention that picks positions out
    k_scale, v_scale = float(b.k_cache.abs().max()) / 448, float(b.v_cache.abs().max()) / 448
    k_cache = (b.k_cache.float() / k_scale).to(torch.float8_e4m3fn)
    v_cache = (b.v_cache.float() / v_scale).to(torch.float8_e4m3fn)
    tile = replace(default_tile_config(head_dim, 4), dense_causal_min_rows=512, dense_any_size=True,
                   dense_causal_whole=whole)
    plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=num_kv_heads,
                                    num_heads=num_heads, head_dim=head_dim, tile=tile, num_sms=device_num_sms("cuda"))
    # (KV positions, causal): the prefix chunk's first 1536 positions, the members' whole prefix,
    # the long chunk's whole 2360-position context, then the squares of 512, 640 and 700 rows;
    # whole: the prefix chunk's and the long chunk's causal calls hold their contexts
    expected = ([[2048, 0], [2048, 1], [3000, 1], [700, 1]] if whole else
                [[1536, 0], [2048, 0], [2360, 0], [512, 1], [640, 1], [700, 1]])
    assert plan.dense[:, [5, 7]].tolist() == expected
    ref = paged_attention_reference(query.float(), k_cache.float() * k_scale, v_cache.float() * v_scale,
                                    b.query_start_loc, b.seq_lens, b.shared_kv_lens, b.block_tables, head_dim ** -0.5)
    on_device = plan_to_device(plan, "cuda")
    library_plan = plan_to_device(build_prefix_shared_plan(
        **b.metadata_numpy(), block_size=16, num_kv_heads=num_kv_heads, num_heads=num_heads, head_dim=head_dim,
        tile=replace(tile, dense_any_size=False, dense_causal_whole=False), num_sms=device_num_sms("cuda")), "cuda")
    library = prefix_shared_attention(query, k_cache, v_cache, library_plan, head_dim ** -0.5, k_scale=k_scale,
                                      v_scale=v_scale).float()
    fa3 = Fa3Dense(torch.device("cuda"), num_heads, num_kv_heads, head_dim)
    on_device.dense_runner = fa3.prepare(on_device.dense)
    outs = [prefix_shared_attention(query, k_cache, v_cache, on_device, head_dim ** -0.5, k_scale=k_scale,
                                    v_scale=v_scale).float() for _ in range(3)]  # three layers of one step
    magnitude = ref.abs().mean()
    assert (library - ref).abs().mean() < 0.01 * magnitude
    for out in outs:
        assert torch.isfinite(out).all()
        assert (out - ref).abs().mean() < 0.1 * magnitude
        torch.testing.assert_close(out, outs[0], atol=0, rtol=0)  # deterministic from layer to layer


def _e4m3_exact_query(num_tokens, num_heads, head_dim, device, step=2.0 ** -5):
    """A query whose rows quantize exactly: e4m3 values times a power of two, each head holding
    +-448 times it, so that its per-head scale is that power of two."""
    generator = torch.Generator().manual_seed(3)
    values = (torch.randn(num_tokens, num_heads, head_dim, generator=generator) * 60).to(torch.float8_e4m3fn).float()
    values[0, :, 0] = 448.0
    return (values * step).to(device)


@pytest.mark.parametrize("whole", [False, True])
def test_fa3_step_on_the_reference_kernel_matches_paged_attention(device, whole):
    """The FA3 step's wiring (ragged batches, quantized rows, the KV gathered as it is, the outputs
    and base-2 log-sum-exps stored, merged with the tiles' parts) with the kernel's float32
    reference in FA3's place: a group's prefix chunk with its members' chunks and decode rows, a
    long chunk after its context, and a fresh prompt, on an FP8 cache, equal to paged attention."""
    from batchllm.ops.fa3_dense import Fa3DenseStep
    from op_references import RaggedFp8PrefillReference

    num_heads, num_kv_heads, head_dim = 6, 2, 32
    seqs = [SeqSpec(24, 64, 0, 0, True), SeqSpec(10, 64 + 10, 64, 0), SeqSpec(14, 64 + 14, 64, 0),
            SeqSpec(1, 64 + 5, 64, 0), SeqSpec(20, 57), SeqSpec(1, 30), SeqSpec(18, 18)]
    b = make_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                   dtype=torch.float32, device=device)
    query = _e4m3_exact_query(b.query.shape[0], num_heads, head_dim, device)
    k_scale, v_scale = float(b.k_cache.abs().max()) / 448, float(b.v_cache.abs().max()) / 448
    k_cache = (b.k_cache / k_scale).to(torch.float8_e4m3fn)
    v_cache = (b.v_cache / v_scale).to(torch.float8_e4m3fn)
    tile = replace(default_tile_config(head_dim, 3), dense_min_rows=16, dense_min_tokens=16, dense_causal_min_rows=16,
                   dense_any_size=True, dense_causal_whole=whole)
    host_plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=num_kv_heads,
                                         num_heads=num_heads, head_dim=head_dim, tile=tile, kv_split_tokens=16)
    # (KV positions, causal, writes to the output): whole, the prefix chunk's and the long
    # chunk's causal calls hold their contexts (40 and 37 positions) and their rows have no
    # other part; else those contexts are unmasked calls beside their squares
    expected = ([[64, 0, 0], [64, 1, 1], [57, 1, 1], [18, 1, 1]] if whole else
                [[40, 0, 0], [64, 0, 0], [37, 0, 0], [24, 1, 0], [20, 1, 0], [18, 1, 1]])
    assert [[kv, causal, int(base < 0)] for kv, base, causal in host_plan.dense[:, 5:8].tolist()] == expected
    plan = plan_to_device(host_plan, device)
    batches, rows = ragged_batches(plan.dense)
    assert [batch.causal for batch in batches] == [False, True]
    references = [RaggedFp8PrefillReference(batch.qo_lens, batch.kv_lens, batch.causal, query.dtype)
                  for batch in batches]
    plan.dense_runner = Fa3DenseStep(batches, references, torch.from_numpy(rows).to(device))
    scale = head_dim ** -0.5
    out = prefix_shared_attention(query, k_cache, v_cache, plan, scale, k_scale=k_scale, v_scale=v_scale)
    ref = paged_attention_reference(query, k_cache.float() * k_scale, v_cache.float() * v_scale, b.query_start_loc,
                                    b.seq_lens, b.shared_kv_lens, b.block_tables, scale)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
