"""CUDA graphs for decode steps give the eager forward's hidden states (GPU only)."""

import pytest
import torch

from batchllm.sched.interface import ScheduledChunk, SchedulerOutput

pytestmark = pytest.mark.gpu


def _decode_step(block_size: int) -> SchedulerOutput:
    chunks = []
    # two groups sharing a 37-token prefix (blocks 0-2), members with own blocks; plus ungrouped seqs
    next_block = 100
    for group in range(2):
        prefix_blocks = tuple(range(3 * group, 3 * group + 3))
        for member in range(5):
            own = tuple(range(next_block, next_block + 2))
            next_block += 2
            position = 37 + 3 + member  # own tokens so far: 3 + member
            chunks.append(ScheduledChunk(seq_id=len(chunks), token_ids=(11 + member,), start_position=position,
                                         num_tokens=1, new_block_ids=prefix_blocks + own, shared_kv_len=37, sample=True,
                                         group_id=group, is_decode=True))
    for single in range(7):
        own = tuple(range(next_block, next_block + 4))
        next_block += 4
        chunks.append(ScheduledChunk(seq_id=len(chunks), token_ids=(5,), start_position=40 + 3 * single,
                                     num_tokens=1, new_block_ids=own, sample=True, is_decode=True))
    return SchedulerOutput(0, tuple(chunks))


def _use_fp8_cache(llm, k_scale: float, v_scale: float) -> None:
    """Swap the engine's KV cache for a float8_e4m3fn one of the same shape holding random values
    (before any graph is captured: the graphs use the runner's cache)."""
    from batchllm.engine.kv_cache import KVCache
    from batchllm.ops.kv_quant import quantize_e4m3

    old = llm.engine.kv_cache
    cache = KVCache(quantize_e4m3(torch.randn_like(old.k, dtype=torch.float32), k_scale),
                    quantize_e4m3(torch.randn_like(old.v, dtype=torch.float32), v_scale), k_scale, v_scale)
    llm.engine.kv_cache = llm.engine.runner.kv_cache = llm.engine.runner.graphs.kv_cache = cache


@pytest.mark.parametrize("backend,kv_cache", [("fused", "auto"), ("triton", "auto"), ("fused", "fp8")])
def test_graph_replay_matches_eager(backend, kv_cache):
    from batchllm import LLM
    from batchllm.engine.step_inputs import build_step_inputs

    llm = LLM(model="random:llama-3.1-8b?num_layers=2&vocab_size=4096", kv_cache_tokens=8192,
              attention_backend=backend)
    runner = llm.engine.runner
    assert runner.graphs is not None
    # fill the cache with something non-trivial
    torch.manual_seed(0)
    if kv_cache == "fp8":
        _use_fp8_cache(llm, k_scale=0.02, v_scale=0.015)
    else:
        llm.engine.kv_cache.k.normal_(0, 1)
        llm.engine.kv_cache.v.normal_(0, 1)
    inputs = build_step_inputs(_decode_step(16), 16)
    with torch.inference_mode():
        eager = runner.forward(inputs, allow_graph=False).float().clone()
        graphed = runner.forward(inputs).float().clone()
        again = runner.forward(inputs).float().clone()  # a replay, not a capture
    assert runner.graphs.num_replays == 2
    assert torch.equal(graphed, again)
    torch.testing.assert_close(graphed, eager, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("every_row", [True, False])
def test_graph_feeds_decode_rows_from_the_last_token_column(every_row):
    """A decode step whose rows take their ids from the runner's last-token column (gathered on
    the device into the graph's static input ids before the replay; all rows, or every other row
    among rows with host ids) gives the hidden states of the same step with every id on the host."""
    import dataclasses

    from batchllm import LLM
    from batchllm.engine.step_inputs import build_step_inputs

    llm = LLM(model="random:llama-3.1-8b?num_layers=2&vocab_size=4096", kv_cache_tokens=8192)
    runner = llm.engine.runner
    torch.manual_seed(0)
    llm.engine.kv_cache.k.normal_(0, 1)
    llm.engine.kv_cache.v.normal_(0, 1)
    given = _decode_step(16)
    fed = [i for i in range(len(given.chunks)) if every_row or i % 2]
    fed_step = dataclasses.replace(given, chunks=tuple(
        dataclasses.replace(c, token_ids=()) if i in fed else c for i, c in enumerate(given.chunks)))
    inputs = build_step_inputs(fed_step, 16)  # a fresh persistent batch: chunk i has row i
    assert inputs.decode_only and inputs.fed_batch_rows.tolist() == fed
    runner.last_tokens.fit(len(given.chunks))
    runner.last_tokens.token_ids[:len(given.chunks)] = torch.tensor([c.token_ids[0] for c in given.chunks])
    with torch.inference_mode():
        eager = runner.forward(build_step_inputs(given, 16), allow_graph=False).float().clone()
        eager_fed = runner.forward(inputs, allow_graph=False).float().clone()
        graphed = runner.forward(inputs).float().clone()
    assert runner.graphs.num_replays == 1
    torch.testing.assert_close(eager_fed, eager, atol=1e-5, rtol=1e-5)  # (a wrong id changes a row entirely)
    torch.testing.assert_close(graphed, eager, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("policy", ["batchllm", "vllm"])
def test_async_scheduling_matches_sync_with_graphs(policy):
    """Asynchronous scheduling on the GPU: decode steps replay graphs whose input ids are gathered
    on the device from the last-token column. Same schedule -> same tokens."""
    from batchllm import LLM, SamplingParams
    from batchllm.engine.run_options import RunOptions

    llm = LLM(model="random:llama-3.1-8b?num_layers=2&vocab_size=4096", kv_cache_tokens=16384, policy=policy,
              max_num_batched_tokens=256)
    prompts = [[7] * 60 + [100 + i % 5] * 20 + [200 + i, 300 + i] for i in range(40)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=5 + i % 13, ignore_eos=True)
              for i in range(40)]
    def tokens(async_scheduling: bool) -> list:
        outputs = llm.generate(prompts, params, use_tqdm=False, options=RunOptions(async_scheduling=async_scheduling))
        return [o.outputs[0].token_ids for o in outputs]

    sync = tokens(False)
    replays_before = llm.engine.runner.graphs.num_replays
    asynchronous = tokens(True)
    assert llm.engine.runner.graphs.num_replays > replays_before
    assert asynchronous == sync
    assert [len(t) for t in sync] == [5 + i % 13 for i in range(40)]


def test_step_launch_never_waits_for_the_device():
    """With asynchronous scheduling a step is launched while the previous one runs: nothing in
    ModelRunner.execute may synchronize with the device (a pageable copy, .item(), ...), or the
    GPU idles while the host launches. torch's sync debug mode turns any such call into an error."""
    from batchllm import LLM, SamplingParams

    llm = LLM(model="random:llama-3.1-8b?num_layers=2&vocab_size=4096", kv_cache_tokens=16384,
              max_num_batched_tokens=256)
    prompts = [[7] * 60 + [100 + i % 5] * 20 + [200 + i, 300 + i] for i in range(40)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=5 + i % 13, ignore_eos=True,
                             logprobs=1 if i % 7 == 0 else None) for i in range(40)]
    first = llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles, captures the graphs
    runner = llm.engine.runner
    execute = runner.execute
    calls = []

    def checked_execute(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            calls.append(1)

    runner.execute = checked_execute
    try:
        second = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.execute = execute
    assert len(calls) > 10
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]
