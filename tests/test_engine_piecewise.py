"""Piecewise steps (the model's pieces over the runner's static buffers, attention between them)
give the plain eager forward's results. On the CPU the pieces run uncaptured through the same
buffers and padding as the captured graphs do on a GPU (tests/test_engine_cuda_graphs.py checks
the replays there)."""

import dataclasses
import os

import pytest
import torch

from batchllm.config import engine_config
from batchllm.engine.graph_shapes import bucket_for, piecewise_buckets, stage_tokens, token_views
from batchllm.engine.kv_cache import KVCache
from batchllm.engine.llm_engine import LLMEngine, PreparedRequest
from batchllm.engine.model_runner import ModelRunner, graph_capacity
from batchllm.engine.run_options import RunOptions
from batchllm.engine.step_inputs import build_step_inputs
from batchllm.ops.transfer import PinnedStaging
from batchllm.sampling_params import SamplingParams
from batchllm.sched.interface import ScheduledChunk, SchedulerOutput

CPU = torch.device("cpu")


def test_decode_graphs_pad_a_step_by_less_than_one_bucket_step():
    """A decode step runs in the smallest graph with a spare row: under 128 rows a power of two,
    then every 64 rows to 512 and every 128 to 2048; none above."""
    from batchllm.engine.graph_shapes import decode_rows_bucket

    steps = (1, 7, 8, 100, 128, 191, 429, 585, 808, 880, 1536, 2047, 2048)
    assert [decode_rows_bucket(n) for n in steps] == [8, 8, 16, 128, 192, 192, 448, 640, 896, 896, 1664, 2048,
                                                      None]
    for num_rows in range(128, 2048):
        bucket = decode_rows_bucket(num_rows)
        assert num_rows < bucket <= num_rows + (64 if num_rows < 512 else 128)


def test_bucket_ladder():
    assert piecewise_buckets(2048) == (8, 16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)
    assert piecewise_buckets(96) == (8, 16, 32, 64, 96)
    assert piecewise_buckets(600) == (8, 16, 32, 64, 128, 256, 512, 600)
    assert piecewise_buckets(8) == (8,)
    buckets = piecewise_buckets(600)
    assert [bucket_for(n, buckets) for n in (1, 8, 9, 257, 512, 513, 600, 601)] == [8, 8, 16, 512, 512, 600, 600, None]
    # the buffers hold the largest bucket and the largest decode graph a step of that size uses
    assert graph_capacity(96) == 128 and graph_capacity(2048) == 2048 and graph_capacity(4000) == 4000


def test_padding_rows_read_id_zero_at_position_zero_and_store_no_kv():
    inputs = build_step_inputs(SchedulerOutput(0, (
        ScheduledChunk(seq_id=0, token_ids=(5, 6, 7), start_position=16, num_tokens=3, new_block_ids=(4, 9)),)), 16)
    staging = PinnedStaging(CPU, num_bytes=64)  # grows as needed
    buffer = torch.full((3 * 6,), 99, dtype=torch.int64)
    staging.begin_step()
    staging.copy(stage_tokens(staging, inputs, 5), buffer[:3 * 6])
    ids, positions, slots = token_views(buffer, 5)
    assert ids.tolist() == [5, 6, 7, 0, 0]
    assert positions.tolist() == [16, 17, 18, 0, 0]
    assert slots.tolist() == [9 * 16, 9 * 16 + 1, 9 * 16 + 2, -1, -1]
    # each array starts 16-byte aligned, whatever the rows
    assert [view.data_ptr() % 16 for view in token_views(buffer, 5)] == [0, 0, 0]
    with pytest.raises(ValueError, match="does not fit"):
        stage_tokens(staging, inputs, 2)


def _requests() -> list[PreparedRequest]:
    """Three prefix groups (40 shared tokens) and prompts of their own; some sampled, some with
    logprobs: steps mix prefix chunks, members' first chunks, chunked prefill and decode rows."""
    requests = []
    for i in range(14):
        prompt = [10 + i % 3] * 40 + list(range(100, 100 + (i % 3) * 5)) + [200 + i, 300 + (i * 7) % 50]
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=4 + i % 5, ignore_eos=True,
                                logprobs=2 if i % 4 == 0 else None, seed=i)
        requests.append(PreparedRequest(i, prompt, params))
    return requests


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(engine_config("random:tiny", dtype="float32", device="cpu", kv_cache_tokens=4096,
                                   max_num_batched_tokens=64))


def _runner(engine, exact: bool = False, piecewise: bool = True, backend: str = "torch") -> ModelRunner:
    """A runner of the engine's model with a KV cache of its own, stepping through the pieces (or
    eagerly). exact: a bucket for every token count (no padding row: the eager forward's shapes)."""
    old = engine.runner
    cache = KVCache.allocate(engine.arch.num_layers, engine.kv_cache.num_blocks, old.block_size,
                             engine.arch.num_kv_heads, engine.arch.head_dim, torch.float32, CPU)
    runner = ModelRunner(old.model, engine.arch, cache, old.block_size, CPU, backend, cuda_graphs=False,
                         max_num_tokens=64, piecewise_on_cpu=piecewise)
    if not piecewise:
        assert runner.piecewise is None
        return runner
    assert runner.piecewise.buckets == piecewise_buckets(64)
    if exact:
        runner.piecewise.buckets = tuple(range(1, 65))
    return runner


def _record_steps(engine) -> list:
    """The (SchedulerOutput, sampling rows) of every step of an eager run of _requests()."""
    steps, execute = [], engine.runner.execute

    def recording(output, rows, allow_graph=True, **kwargs):
        steps.append((output, rows))
        return execute(output, rows, allow_graph, **kwargs)

    engine.runner.execute = recording
    try:
        list(engine.run(_requests(), options=RunOptions(async_scheduling=False)))
    finally:
        del engine.runner.execute
    return steps


def _forward_outputs(runner) -> list:
    """Wrap runner._forward to keep a copy of every step's hidden states (the view of the buffers
    lives one step)."""
    hidden, forward = [], runner._forward

    def keeping(*args, **kwargs):
        out = forward(*args, **kwargs)
        hidden.append(out.clone())
        return out

    runner._forward = keeping
    return hidden


@pytest.mark.parametrize("exact,backend", [(True, "torch"), (False, "torch"), (True, "reference")])
def test_piecewise_steps_equal_the_eager_forward(engine, exact, backend):
    """Replays every step of a real schedule (prefix chunks with their members, chunked prefill,
    decode rows fed from the last-token column) on an eager runner and on a piecewise one, each
    with its own KV cache. Without padding rows every hidden state, sampled id, logprob and the
    whole KV cache are bit for bit the same; padded to the buckets they agree to float32 rounding
    (a GEMM's rows may round differently at another row count) and sample the same ids."""
    steps = _record_steps(engine)
    kinds = [(any(c.is_prefix for c in o.chunks), any(c.is_decode for c in o.chunks),
              any(not c.is_decode and not c.is_prefix for c in o.chunks)) for o, _ in steps]
    assert any(prefix and prompt for prefix, _, prompt in kinds)  # a prefix chunk with its members' chunks
    assert any(decode and prompt for _, decode, prompt in kinds)  # decode rows among prompt chunks
    assert any(decode and not prompt and not prefix for prefix, decode, prompt in kinds)  # a decode step
    eager, piecewise = _runner(engine, piecewise=False, backend=backend), _runner(engine, exact, backend=backend)
    eager_hidden, piecewise_hidden = _forward_outputs(eager), _forward_outputs(piecewise)
    for output, rows in steps:
        a, b = eager.execute(output, rows), piecewise.execute(output, rows)
        assert (eager.last_mode, piecewise.last_mode) == ("eager", "piecewise")
        assert list(a.seq_ids) == list(b.seq_ids)
        assert torch.equal(a.sampled.token_ids, b.sampled.token_ids)
        if exact:
            assert torch.equal(eager_hidden[-1], piecewise_hidden[-1])
        else:
            torch.testing.assert_close(piecewise_hidden[-1], eager_hidden[-1], atol=2e-5, rtol=2e-5)
        if a.sampled.logprobs is not None:
            torch.testing.assert_close(b.sampled.logprobs, a.sampled.logprobs, atol=0 if exact else 1e-5,
                                       rtol=0 if exact else 1e-5)
    assert piecewise.graph_counts() == {"graph_replays": 0, "piecewise_steps": len(steps), "piece_replays": 0,
                                       "eager_steps": 0}
    if exact:
        assert torch.equal(eager.kv_cache.k, piecewise.kv_cache.k)
        assert torch.equal(eager.kv_cache.v, piecewise.kv_cache.v)
    else:
        torch.testing.assert_close(piecewise.kv_cache.k, eager.kv_cache.k, atol=2e-5, rtol=2e-5)


def test_padding_rows_write_no_kv(engine):
    """A piecewise step of 3 tokens padded to 8 rows writes its 3 slots and no other."""
    runner = _runner(engine)
    step = SchedulerOutput(0, (ScheduledChunk(seq_id=0, token_ids=(5, 6, 7), start_position=0, num_tokens=3,
                                              new_block_ids=(2,)),))
    before = runner.kv_cache.k.clone()
    runner.forward(runner.step_inputs(step))
    assert runner.last_mode == "piecewise" and runner.piecewise.bucket(3) == 8
    changed = (runner.kv_cache.k != before).flatten(3).any(-1)  # [layer, block, offset]
    assert changed.nonzero().tolist() == [[layer, 2, offset] for layer in range(engine.arch.num_layers)
                                          for offset in range(3)]


def test_engine_runs_piecewise_and_eager_alike(engine):
    """A whole run through piecewise steps (asynchronous scheduling, sampled and greedy rows,
    logprobs) gives the eager run's outputs; RunOptions(cuda_graphs=False) runs it eagerly."""
    reference = {o.request_id: o for o in engine.run(_requests())}
    runner, engine.runner = engine.runner, _runner(engine, exact=True)
    try:
        piecewise = {o.request_id: o for o in engine.run(_requests())}
        counts = engine.runner.graph_counts()
        assert counts["piecewise_steps"] > 0 and counts["eager_steps"] == 0
        eager = {o.request_id: o for o in engine.run(_requests(), options=RunOptions(cuda_graphs=False))}
        assert engine.runner.graph_counts()["piecewise_steps"] == counts["piecewise_steps"]
        assert engine.runner.graph_counts()["eager_steps"] > 0
    finally:
        engine.runner = runner
    for outputs in (piecewise, eager):
        assert {i: o.output_token_ids for i, o in outputs.items()} == \
            {i: o.output_token_ids for i, o in reference.items()}
        assert {i: o.logprobs for i, o in outputs.items()} == {i: o.logprobs for i, o in reference.items()}


def test_steps_above_the_largest_bucket_run_eagerly_until_the_graphs_grow(engine):
    runner = _runner(engine)
    prompt = SchedulerOutput(0, (ScheduledChunk(seq_id=0, token_ids=tuple(range(3, 83)), start_position=0,
                                                num_tokens=80, new_block_ids=tuple(range(5))),))
    runner.forward(runner.step_inputs(prompt))
    assert runner.last_mode == "eager"  # 80 tokens > the buckets' 64, and more rows than the buffers hold
    runner.ensure_step_capacity(80)
    assert runner.piecewise.buckets[-1] == 80 and runner.buffers.capacity >= 80
    runner.ensure_step_capacity(64)  # no smaller
    assert runner.piecewise.buckets[-1] == 80
    runner.capture_graphs()  # again (a new KV cache), for the same steps: not for the buffers' 128 rows
    assert runner.piecewise.buckets[-1] == 80 and runner.buffers.capacity == 128
    again = SchedulerOutput(1, (ScheduledChunk(seq_id=1, token_ids=tuple(range(3, 83)), start_position=0,
                                               num_tokens=80, new_block_ids=tuple(range(5, 10))),))
    runner.forward(runner.step_inputs(again))
    assert runner.last_mode == "piecewise"


class ClosureCapture:
    """Stands in for GraphCapture on the CPU: a 'captured' graph keeps the function it was given,
    run once at capture (the warm-up) and again at every replay. This runs the runner's graph
    control flow (capture at start-up, replay per bucket, the decode graphs' padded plans and
    persistent launches) without a GPU; what CUDA itself records is checked on a GPU
    (tests/test_engine_cuda_graphs.py)."""

    def __init__(self):
        self.num_captured = 0
        self.captured = []

    def capture(self, run, what):
        run()
        self.num_captured += 1
        self.captured.append(what)
        return _ClosureGraph(run)


class _ClosureGraph:
    def __init__(self, run):
        self.replay, self.num_resets = run, 0

    def reset(self):
        self.num_resets += 1


def test_captured_pieces_replay_per_bucket(engine):
    """With a capture, every piece of every bucket is captured up front, largest bucket first, and a
    step replays its bucket's pieces: the uncaptured pieces' results."""
    from batchllm.engine.piecewise_graphs import PiecewiseGraphs

    uncaptured, graphed = _runner(engine), _runner(engine)
    capture = ClosureCapture()
    graphed.piecewise = PiecewiseGraphs(graphed.model, graphed.kv_cache, graphed.backend, graphed.scale,
                                        graphed.buffers, graphed.staging, (8, 16, 64), capture)
    graphed.capture = capture
    graphed.piecewise.capture_all()
    pieces = engine.arch.num_layers + 1
    assert capture.captured[:2] == ["piece 0 of 64-token steps", "piece 1 of 64-token steps"]
    assert capture.num_captured == 3 * pieces
    # the capture left no KV behind (its rows had slot -1)
    assert not graphed.kv_cache.k.any() and not graphed.kv_cache.v.any()
    step = SchedulerOutput(0, (ScheduledChunk(seq_id=0, token_ids=tuple(range(3, 14)), start_position=0,
                                              num_tokens=11, new_block_ids=(0,)),))
    expected = uncaptured.forward(uncaptured.step_inputs(step)).clone()
    hidden = graphed.forward(graphed.step_inputs(step))
    assert graphed.last_mode == "piecewise" and graphed.piecewise.num_replays == pieces
    assert graphed.graph_counts()["piece_replays"] == pieces
    assert torch.equal(hidden, expected)
    graphs = [graph for bucket in graphed.piecewise.graphs.values() for graph in bucket]
    graphed.release_graphs()
    assert graphed.piecewise is None and all(graph.num_resets == 1 for graph in graphs)


def _decode_graph_runner(engine, xqa=None):
    """A runner of the engine's model over a random float32 cache of 64 blocks, with decode graphs
    'captured' by ClosureCapture (and `xqa` as its backend's XQA kernel); (runner, capture)."""
    from batchllm.engine.cuda_graphs import DecodeGraphRunner

    arch = engine.arch
    cache = KVCache.allocate(arch.num_layers, 64, 16, arch.num_kv_heads, arch.head_dim, torch.float32, CPU)
    torch.manual_seed(0)
    cache.k.normal_()
    cache.v.normal_()
    runner = ModelRunner(engine.runner.model, arch, cache, 16, CPU, "fused", cuda_graphs=False, max_num_tokens=64,
                         piecewise_on_cpu=True)
    runner.backend.xqa = xqa
    capture = ClosureCapture()
    runner.graphs = DecodeGraphRunner(runner.model, cache, runner.backend, runner.scale, runner.buffers,
                                      runner.staging, capture)
    return runner, capture


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused backend on CPU tensors needs Triton's interpreter (set where no GPU is)")
def test_decode_graphs_replay_a_padded_plan(engine):
    """A decode step through a whole-step decode graph (the fused backend's persistent, class-split
    launches over the padded plan, in Triton's interpreter) gives the eager step's hidden states;
    the next decode step of the same shape replays the graph without capturing again."""
    runner, capture = _decode_graph_runner(engine)
    chunks = [ScheduledChunk(seq_id=i, token_ids=(7 + i,), start_position=10 + 4 * i, num_tokens=1,
                             new_block_ids=(2 * i, 2 * i + 1), shared_kv_len=0, sample=True, is_decode=True)
              for i in range(5)]
    step = build_step_inputs(SchedulerOutput(0, tuple(chunks)), 16)
    eager = runner.forward(step, allow_graph=False).clone()
    graphed = runner.forward(step).clone()
    assert runner.last_mode == "graph_replay" and capture.captured == ["decode steps of 8 rows"]
    torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=1e-5)
    later_chunks = tuple(dataclasses.replace(c, token_ids=(3,), start_position=c.start_position + 1)
                         for c in chunks[:3])
    later = build_step_inputs(SchedulerOutput(1, later_chunks), 16)
    eager_later = runner.forward(later, allow_graph=False).clone()
    torch.testing.assert_close(runner.forward(later), eager_later, atol=1e-5, rtol=1e-5)
    assert runner.graphs.num_replays == 2 and capture.num_captured == 1


class _ReferenceXqa:
    """Stands in for XQA (ops/xqa_decode.py) on the CPU: row i attends positions [0, seq_lens[i]) through
    block-table row i, by the reference; counts its calls."""

    def __init__(self) -> None:
        self.num_calls = 0

    def __call__(self, query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, out):
        from batchllm.ops.reference import paged_attention_reference

        self.num_calls += 1
        num_rows = query.shape[0]
        starts = torch.arange(num_rows + 1, dtype=torch.int32)
        result = paged_attention_reference(query, k_cache, v_cache, starts, seq_lens, torch.zeros_like(seq_lens),
                                           block_tables, scale, k_scale=k_scale, v_scale=v_scale)
        return result if out is None else out.copy_(result)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused backend on CPU tensors needs Triton's interpreter (set where no GPU is)")
def test_decode_graphs_of_lone_rows_attend_by_xqa(engine):
    """With an XQA kernel (here the reference in its place), a decode step whose rows share no KV
    runs a graph keyed for it, whose plan hands every layer the rows' block tables and KV positions
    (padding rows: 1), and gives the eager step's hidden states; a step with a group prefix runs a
    work-list graph of the same rows and width."""
    xqa = _ReferenceXqa()
    runner, _ = _decode_graph_runner(engine, xqa)
    arch = engine.arch
    lone = [ScheduledChunk(seq_id=i, token_ids=(7 + i,), start_position=10 + 4 * i, num_tokens=1,
                           new_block_ids=(2 * i, 2 * i + 1), shared_kv_len=0, sample=True, is_decode=True)
            for i in range(5)]
    grouped = [ScheduledChunk(seq_id=10 + i, token_ids=(3 + i,), start_position=21 + i, num_tokens=1,
                              new_block_ids=(20, 21 + i), shared_kv_len=16, sample=True, group_id=0, is_decode=True)
               for i in range(3)]
    for chunks, by_xqa in ((lone, True), (grouped, False)):
        step = build_step_inputs(SchedulerOutput(0, tuple(chunks)), 16)
        key = runner.graphs.key_for(step, runner.backend.build_plan(step))
        assert key.xqa is by_xqa
        eager = runner.forward(step, allow_graph=False).clone()
        calls = xqa.num_calls
        graphed = runner.forward(step).clone()
        assert runner.last_mode == "graph_replay"
        # the closure "capture" runs the step again at each replay: XQA in every layer, or never
        assert xqa.num_calls - calls == (2 * arch.num_layers if by_xqa else 0)
        torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=1e-5)
    seq_lens = {key.xqa: graph.layout.views(graph.plan32)["seq_lens"].tolist()
                for key, graph in runner.graphs.graphs.items()}
    assert seq_lens[True] == [11, 15, 19, 23, 27, 1, 1, 1]
