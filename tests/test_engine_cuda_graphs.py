"""CUDA graphs (GPU only): whole-step graphs of decode steps and the piecewise graphs of every other
step give the eager forward's hidden states, in bf16 and with FP8 weights and an FP8 KV cache;
the piecewise graphs are captured at start-up, and a capture that fails stops the engine. (The
same pieces, buffers and padding run uncaptured on the CPU: tests/test_engine_piecewise.py.)"""

import dataclasses

import pytest
import torch

from batchllm.sched.interface import ScheduledChunk, SchedulerOutput

pytestmark = pytest.mark.gpu

MODEL = "random:llama-3.1-8b?num_layers=2&vocab_size=4096"


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


def _mixed_step() -> SchedulerOutput:
    """A step with prefill chunks: a group's 37-token prefix chunk with its four members' first
    chunks, 100 rows of a prompt past its first 20 tokens, and seven decode rows (156 rows: the
    256-token bucket, 100 padding rows)."""
    prefix_blocks = (0, 1, 2)
    chunks = [ScheduledChunk(seq_id=-1, token_ids=tuple(range(50, 87)), start_position=0, num_tokens=37,
                             new_block_ids=prefix_blocks, is_prefix=True, group_id=0)]
    for member in range(4):
        chunks.append(ScheduledChunk(seq_id=10 + member, token_ids=(11 + member, 12, 13), start_position=37,
                                     num_tokens=3, new_block_ids=prefix_blocks + (100 + member,), shared_kv_len=37,
                                     sample=True, group_id=0))
    chunks.append(ScheduledChunk(seq_id=20, token_ids=tuple(range(200, 300)), start_position=20, num_tokens=100,
                                 new_block_ids=tuple(range(110, 118)), sample=True))
    for single in range(7):
        chunks.append(ScheduledChunk(seq_id=30 + single, token_ids=(5 + single,), start_position=40 + 3 * single,
                                     num_tokens=1, new_block_ids=tuple(range(120 + 4 * single, 124 + 4 * single)),
                                     sample=True, is_decode=True))
    return SchedulerOutput(0, tuple(chunks))


def _random_cache(llm, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Fill the engine's KV cache with random values; an FP8 cache is replaced by one of the same
    shape with the given scales, and the graphs, which capture the cache, are captured again."""
    from batchllm.engine.kv_cache import KVCache
    from batchllm.ops.kv_quant import quantize_e4m3

    torch.manual_seed(0)
    old, runner = llm.engine.kv_cache, llm.engine.runner
    if not old.is_fp8:
        old.k.normal_(0, 1)
        old.v.normal_(0, 1)
        return
    cache = KVCache(quantize_e4m3(torch.randn_like(old.k, dtype=torch.float32), k_scale),
                    quantize_e4m3(torch.randn_like(old.v, dtype=torch.float32), v_scale), k_scale, v_scale)
    llm.engine.kv_cache = runner.kv_cache = cache
    runner.capture_graphs()


@pytest.mark.parametrize("backend,kv_cache", [("fused", "auto"), ("triton", "auto"), ("fused", "fp8")])
def test_graph_replay_matches_eager(backend, kv_cache):
    from batchllm import LLM
    from batchllm.engine.step_inputs import build_step_inputs

    llm = LLM(model=MODEL, kv_cache_tokens=8192, attention_backend=backend, kv_cache_dtype=kv_cache)
    runner = llm.engine.runner
    assert runner.graphs is not None
    _random_cache(llm, k_scale=0.02, v_scale=0.015)
    inputs = build_step_inputs(_decode_step(16), 16)
    eager = runner.forward(inputs, allow_graph=False).float().clone()
    graphed = runner.forward(inputs).float().clone()
    assert runner.last_mode == "graph_replay"
    again = runner.forward(inputs).float().clone()  # a replay, not a capture
    assert runner.graphs.num_replays == 2
    assert torch.equal(graphed, again)
    torch.testing.assert_close(graphed, eager, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("quantization,kv_cache,backend", [(None, "auto", "fused"), (None, "auto", "triton"),
                                                           ("fp8", "fp8", "fused"), ("fp8", "auto", "fused")])
def test_piecewise_replay_matches_eager(quantization, kv_cache, backend):
    """A step with prefill chunks replays the piecewise graphs of its bucket, captured at start-up,
    with eager attention between them: the eager forward's hidden states and KV, and its padding
    rows store no KV."""
    from batchllm import LLM
    from batchllm.engine.step_inputs import build_step_inputs

    llm = LLM(model=MODEL, kv_cache_tokens=8192, quantization=quantization, kv_cache_dtype=kv_cache,
              attention_backend=backend)
    runner = llm.engine.runner
    pieces = runner.model.num_pieces
    assert runner.capture.num_captured == len(runner.piecewise.buckets) * pieces  # all at start-up
    _random_cache(llm, k_scale=0.02, v_scale=0.015)
    inputs = build_step_inputs(_mixed_step(), 16)
    assert runner.piecewise.bucket(inputs.num_tokens) == 256 > inputs.num_tokens == 156
    cache = llm.engine.kv_cache
    before = cache.k.float().clone()
    eager = runner.forward(inputs, allow_graph=False).float().clone()
    assert runner.last_mode == "eager"
    eager_k = cache.k.float().clone()
    captured = runner.capture.num_captured
    graphed = runner.forward(inputs).float().clone()
    assert runner.last_mode == "piecewise" and runner.piecewise.num_replays == pieces
    again = runner.forward(inputs).float().clone()
    assert runner.piecewise.num_replays == 2 * pieces and runner.capture.num_captured == captured  # no capture
    assert torch.equal(graphed, again)
    torch.testing.assert_close(graphed, eager, atol=3e-2, rtol=3e-2)
    # the step's slots hold what the eager step wrote; every other slot is as it was
    written = (eager_k != before).flatten(3).any(-1)
    assert written.any()
    assert torch.equal((cache.k.float() != before).flatten(3).any(-1) & ~written,
                       torch.zeros_like(written))
    # and the piecewise step wrote the eager step's values there, up to rounding (a GEMM of 256 rows
    # may round differently from one of 156; an e4m3 step is 1/8 relative)
    far = (cache.k.float() - eager_k).abs() > 0.26 * eager_k.abs() + 1e-2
    assert far.float().mean() < 1e-3


@pytest.mark.parametrize("step", ["decode", "mixed"])
def test_graphs_feed_rows_from_the_last_token_column(step):
    """Decode rows whose ids come from the runner's last-token column (gathered on the device into
    the graph's static input ids before the replay; all rows, or rows among prompt chunks) give
    the hidden states of the same step with every id on the host: a decode step's whole-step graph,
    a mixed step's piecewise graphs."""
    from batchllm import LLM
    from batchllm.engine.step_inputs import build_step_inputs

    llm = LLM(model=MODEL, kv_cache_tokens=8192)
    runner = llm.engine.runner
    _random_cache(llm)
    given = _decode_step(16) if step == "decode" else _mixed_step()
    fed = [i for i, c in enumerate(given.chunks) if c.is_decode and (step == "decode" or i % 2)]
    fed_step = dataclasses.replace(given, chunks=tuple(
        dataclasses.replace(c, token_ids=()) if i in fed else c for i, c in enumerate(given.chunks)))
    inputs = build_step_inputs(fed_step, 16)  # a fresh persistent batch: chunk i has row i
    assert inputs.fed_batch_rows.tolist() == fed
    runner.last_tokens.fit(len(given.chunks))
    runner.last_tokens.token_ids[fed] = torch.tensor([given.chunks[i].token_ids[0] for i in fed], device="cuda")
    eager = runner.forward(build_step_inputs(given, 16), allow_graph=False).float().clone()
    eager_fed = runner.forward(inputs, allow_graph=False).float().clone()
    graphed = runner.forward(inputs).float().clone()
    assert runner.last_mode == ("graph_replay" if step == "decode" else "piecewise")
    torch.testing.assert_close(eager_fed, eager, atol=1e-5, rtol=1e-5)  # (a wrong id changes a row entirely)
    torch.testing.assert_close(graphed, eager, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("policy,quantization", [("batchllm", None), ("vllm", None), ("batchllm", "fp8")])
def test_async_scheduling_matches_sync_with_graphs(policy, quantization):
    """Asynchronous scheduling on the GPU: decode steps replay whole-step graphs, the others
    piecewise graphs, with input ids gathered on the device from the last-token column; no step
    runs eagerly. Same schedule -> same tokens."""
    from batchllm import LLM, SamplingParams
    from batchllm.engine.run_options import RunOptions

    llm = LLM(model=MODEL, kv_cache_tokens=16384, policy=policy, max_num_batched_tokens=256,
              quantization=quantization, kv_cache_dtype="fp8" if quantization else "auto")
    prompts = [[7] * 60 + [100 + i % 5] * 20 + [200 + i, 300 + i] for i in range(40)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=5 + i % 13, ignore_eos=True,
                             logprobs=2 if i % 7 == 0 else None)
              for i in range(40)]

    def run(async_scheduling: bool) -> list:
        outputs = llm.generate(prompts, params, use_tqdm=False, options=RunOptions(async_scheduling=async_scheduling))
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    sync = run(False)
    before = llm.engine.runner.graph_counts()
    asynchronous = run(True)
    after = llm.engine.runner.graph_counts()
    assert after["graph_replays"] > before["graph_replays"]
    assert after["piecewise_steps"] > before["piecewise_steps"]
    assert after["eager_steps"] == before["eager_steps"]
    assert asynchronous == sync
    assert [len(t) for t, _ in sync] == [5 + i % 13 for i in range(40)]


def _generate_without_syncs(llm, prompts, params, monkeypatch) -> tuple[list, list[str]]:
    """llm.generate with torch's sync debug mode on around every ModelRunner.execute (any call that
    synchronizes with the device raises there): the outputs, and the mode each step ran in."""
    runner = llm.engine.runner
    execute = runner.execute
    modes = []

    def checked_execute(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            modes.append(runner.last_mode)

    monkeypatch.setattr(runner, "execute", checked_execute)  # restored when the test ends
    return llm.generate(prompts, params, use_tqdm=False), modes


def test_step_launch_never_waits_for_the_device(monkeypatch):
    """With asynchronous scheduling a step is launched while the previous one runs: nothing in
    ModelRunner.execute may synchronize with the device (a pageable copy, .item(), ...), or the
    GPU idles while the host launches. torch's sync debug mode turns any such call into an error.
    Both kinds of graphed steps run under it."""
    from batchllm import LLM, SamplingParams

    llm = LLM(model=MODEL, kv_cache_tokens=16384, max_num_batched_tokens=256)
    prompts = [[7] * 60 + [100 + i % 5] * 20 + [200 + i, 300 + i] for i in range(40)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=5 + i % 13, ignore_eos=True,
                             logprobs=1 if i % 7 == 0 else None) for i in range(40)]
    first = llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles, captures the decode graphs
    second, modes = _generate_without_syncs(llm, prompts, params, monkeypatch)
    assert len(modes) > 10 and {"graph_replay", "piecewise"} <= set(modes) and "eager" not in modes
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]


@pytest.mark.parametrize("kv_cache,backend,prompt_tokens,budget", [
    ("auto", "fused", 3000, 2048), ("fp8", "fused", 3000, 2048), ("fp8", "xqa", 3000, 2048),
    ("auto", "fused", 6000, 8192), ("fp8", "fused", 6000, 8192), ("fp8", "fused", 8192, 8192)])
def test_steps_with_dense_calls_never_wait_for_the_device(monkeypatch, kv_cache, backend, prompt_tokens, budget):
    """The same check on steps whose prompt chunks run dense calls on the library kernel beside the
    work list, with a bf16 and an FP8 cache, and with XQA's lead rows and FA3's dense calls where
    FlashInfer is installed: gathering a call's blocks, converting FP8, padding its rows and
    planning FA3 must not synchronize either.
    Prompts of 3,000 tokens at 2,048 a step: a prompt's later chunk has at least 512 rows over at
    least 1,024 earlier positions, the least a context call takes (prompts of 1,100 made none).
    Prompts of 6,000 at 8,192 a step add causal squares (chunks of at least 4,096 rows), as long
    prompts' first chunks run; prompts of 8,192 make only squares, the first step's square its
    whole output (prefix_attention.whole_step_call)."""
    import importlib.util

    from batchllm import LLM, SamplingParams
    from batchllm.ops import prefix_attention

    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    if backend == "xqa" and not (importlib.util.find_spec("flashinfer") and hopper):
        pytest.skip("needs FlashInfer and a Hopper GPU")
    llm = LLM(model=MODEL, kv_cache_tokens=65536, max_num_batched_tokens=budget, kv_cache_dtype=kv_cache,
              attention_backend=backend)
    num_prompts = 36000 // prompt_tokens
    prompts = [[100 + i] * prompt_tokens for i in range(num_prompts)]  # nothing shared: decode rows lead
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles, builds the library's plans
    dense_output, calls = prefix_attention._dense_output, []

    def counted_dense_output(call, *args, **kwargs):
        calls.append(call.causal)
        return dense_output(call, *args, **kwargs)

    monkeypatch.setattr(prefix_attention, "_dense_output", counted_dense_output)
    if llm.engine.runner.backend.fa3_dense is not None:  # xqa on Hopper: FA3 runs the dense calls
        from batchllm.ops.fa3_dense import Fa3DenseStep

        fa3_step = Fa3DenseStep.__call__

        def counted_fa3_step(self, *args, **kwargs):
            calls.extend(call.causal for batch in self.batches for call in batch.calls)
            return fa3_step(self, *args, **kwargs)

        monkeypatch.setattr(Fa3DenseStep, "__call__", counted_fa3_step)
    second, modes = _generate_without_syncs(llm, prompts, params, monkeypatch)
    assert "piecewise" in modes and "eager" not in modes and calls
    # cuDNN's causal calls start at 4,096 rows, FA3's at 512
    assert (True in calls) is (prompt_tokens >= 4096 or llm.engine.runner.backend.fa3_dense is not None)
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]


def test_enforce_eager_and_run_options_run_eagerly():
    from batchllm import LLM, SamplingParams
    from batchllm.engine.run_options import RunOptions

    prompts = [[7] * 30 + [200 + i] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eager_llm = LLM(model=MODEL, kv_cache_tokens=8192, enforce_eager=True)
    assert eager_llm.engine.runner.graphs is None and eager_llm.engine.runner.piecewise is None
    eager_llm.generate(prompts, params, use_tqdm=False)
    counts = eager_llm.engine.runner.graph_counts()
    assert counts["eager_steps"] == eager_llm.last_run_stats.num_steps >= 4
    assert counts["piecewise_steps"] == counts["graph_replays"] == 0
    llm = LLM(model=MODEL, kv_cache_tokens=8192)
    llm.generate(prompts, params, use_tqdm=False, options=RunOptions(cuda_graphs=False))
    counts = llm.engine.runner.graph_counts()
    assert counts["eager_steps"] == llm.last_run_stats.num_steps >= 4
    assert counts["piecewise_steps"] == counts["graph_replays"] == 0


def test_a_larger_token_budget_captures_larger_graphs():
    """A run whose token budget exceeds the one the graphs were captured for captures them again,
    larger, before its first step: its full steps replay graphs instead of running eagerly."""
    from batchllm import LLM, SamplingParams

    llm = LLM(model=MODEL, kv_cache_tokens=16384, max_num_batched_tokens=128)
    assert llm.engine.runner.piecewise.buckets[-1] == 128
    llm.engine.configure_scheduler(max_num_batched_tokens=512)
    prompts = [[7] * 200 + [200 + i] for i in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    runner = llm.engine.runner
    assert runner.piecewise.buckets[-1] == 512
    assert runner.graph_counts()["eager_steps"] == 0


def test_a_failed_capture_stops_the_engine():
    """A piece that cannot be captured (here: one that reads a value back to the host, which a
    capture forbids) raises at start-up, naming --enforce-eager; the runner does not fall back to
    eager steps."""
    from batchllm import LLM
    from batchllm.engine.graph_capture import GraphCaptureError

    llm = LLM(model=MODEL, kv_cache_tokens=8192, max_num_batched_tokens=64)
    runner = llm.engine.runner
    piece = runner.model.piece

    def syncing_piece(*args, **kwargs):
        out = piece(*args, **kwargs)
        out.residual.sum().item()
        return out

    runner.model.piece = syncing_piece
    try:
        with pytest.raises(GraphCaptureError, match="enforce-eager"):
            runner.capture_graphs()
    finally:
        del runner.model.piece
    torch.cuda.synchronize()
