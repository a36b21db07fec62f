"""The `xqa` attention backend: decode graphs of steps whose rows share no KV attend by FlashInfer's
XQA kernel (ops/xqa_decode.py). On the CPU: what it refuses, which steps it takes, how the graph
hands it the rows' KV positions and how the backend calls it. On a Hopper GPU with FlashInfer
installed: the kernel against the reference, and the engine's XQA graphs against its eager steps."""

import importlib.util
import types

import numpy as np
import pytest
import torch

from graph_helpers import capture_and_replay
from synthetic_batch import SeqSpec, make_batch

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
K_SCALE, V_SCALE = 0.02, 0.015


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.parametrize("device,capability,kv_dtype,block_size,head_dim,windows,message", [
    ("cpu", None, torch.float8_e4m3fn, 16, 128, (), "runs on a CUDA GPU, not on cpu"),
    ("cuda", (8, 0), torch.float8_e4m3fn, 16, 128, (), "needs a Hopper GPU"),
    ("cuda", (9, 0), torch.bfloat16, 16, 128, (), "add --kv-cache-dtype fp8"),
    ("cuda", (9, 0), None, 16, 128, (), "add --kv-cache-dtype fp8"),
    ("cuda", (9, 0), torch.float8_e4m3fn, 8, 128, (), "blocks of (16, 32, 64, 128) tokens, not 8"),
    ("cuda", (9, 0), torch.float8_e4m3fn, 16, 96, (), "heads of (64, 128, 256) dimensions, not 96"),
    ("cuda", (9, 0), torch.float8_e4m3fn, 16, 128, (None, 4096), "sliding window"),
])
def test_xqa_refuses_what_it_cannot_run(monkeypatch, device, capability, kv_dtype, block_size, head_dim, windows,
                                        message):
    from batchllm.ops.xqa_decode import check_xqa_supported

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_xqa_supported(torch.device(device), kv_dtype, block_size, head_dim, windows)


def test_xqa_backend_refused_on_cpu_and_accepted_by_the_config():
    from batchllm.config import EngineConfig
    from batchllm.engine.attention.select import AttentionShape, select_backend

    assert EngineConfig(attention_backend="xqa").attention_backend == "xqa"
    with pytest.raises(ValueError, match="runs on a CUDA GPU"):
        select_backend("xqa", torch.device("cpu"), AttentionShape(16, 32, 8, 128, (), torch.float8_e4m3fn))


FP8_SHAPE = dict(block_size=16, num_heads=32, num_kv_heads=8, head_dim=128, kv_cache_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("device,capability,installed,changes,expected", [
    ("cpu", None, True, {}, "torch"),
    ("cuda", (9, 0), True, {}, "xqa"),
    ("cuda", (9, 0), False, {}, "fused"),
    ("cuda", (8, 9), True, {}, "fused"),
    ("cuda", (9, 0), True, {"kv_cache_dtype": torch.bfloat16}, "fused"),
    ("cuda", (9, 0), True, {"kv_cache_dtype": None}, "fused"),
    ("cuda", (9, 0), True, {"head_dim": 96}, "fused"),
    ("cuda", (9, 0), True, {"layer_windows": (None, 4096)}, "fused"),
])
def test_auto_picks_xqa_only_where_it_runs(monkeypatch, device, capability, installed, changes, expected):
    from batchllm.engine.attention import select

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(select, "xqa_installed", lambda: installed)
    shape = select.AttentionShape(**{**FP8_SHAPE, **changes})
    assert select.resolve_backend_name("auto", torch.device(device), shape) == expected
    assert select.resolve_backend_name("auto", torch.device(device)) == ("torch" if device == "cpu" else "fused")
    assert select.resolve_backend_name("fused", torch.device(device), shape) == "fused"


def test_auto_runs_fused_with_a_warning_when_xqa_cannot_be_built(monkeypatch):
    """XQA builds at start-up; where "auto" picked it and the build fails, the engine runs `fused` and
    says why; where the user asked for xqa, the build's error stands."""
    from batchllm.engine.attention import select

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(select, "xqa_installed", lambda: True)
    builds = []

    class FailingXqa:  # XqaDecode whose build fails as it does on a host without nvcc
        def __init__(self, device):
            pass

        def build(self, *shape):
            builds.append(shape)
            raise RuntimeError("Could not find nvcc")

    monkeypatch.setattr(select, "XqaDecode", FailingXqa)
    monkeypatch.setattr(select, "_triton_backend", lambda device, shape, uses_groups, kv_fp8, xqa=None:
                        types.SimpleNamespace(uses_groups=uses_groups, kv_fp8=kv_fp8, xqa=xqa))
    shape = select.AttentionShape(**FP8_SHAPE)
    with pytest.warns(RuntimeWarning, match=r"XQA could not be built \(Could not find nvcc\); running the fused"):
        selected = select.select_backend("auto", torch.device("cuda"), shape)
    assert selected.name == "fused" and selected.backend.xqa is None
    assert selected.backend.uses_groups and selected.backend.kv_fp8
    with pytest.raises(RuntimeError, match="Could not find nvcc"):
        select.select_backend("xqa", torch.device("cuda"), shape)
    assert builds == [(32, 8, 128, 16)] * 2


@pytest.mark.skipif(HAS_FLASHINFER, reason="FlashInfer is installed here")
def test_xqa_without_flashinfer_says_how_to_install_it():
    from batchllm.ops.xqa_decode import XqaDecode

    with pytest.raises(RuntimeError, match="pip install flashinfer-python"):
        XqaDecode(torch.device("cpu"))


def test_xqa_decode_hands_the_kernel_a_dense_query_and_its_scales(monkeypatch):
    """The model's query is a strided view (rows of its QKV projection): XQA, which reads the query
    densely, gets a contiguous copy; seq lens as uint32, the table's span in positions as the
    longest sequence, the caches' scales folded into XQA's two."""
    from batchllm.ops import xqa_decode

    calls = []

    def kernel(query, caches, workspace, tables, seq_lens, max_seq_len, **scales):
        calls.append((query.is_contiguous(), query.clone(), seq_lens.dtype, max_seq_len, scales))
        return scales["out"].fill_(1.0)

    monkeypatch.setattr(xqa_decode, "_xqa_kernel", lambda: kernel)
    xqa = xqa_decode.XqaDecode(torch.device("cpu"), workspace_bytes=64)
    qkv = torch.randn(3, 6 * 16)  # 4 query heads, 1 key and 1 value head of 16
    query = qkv[:, :64].view(3, 4, 16)
    assert not query.is_contiguous()
    caches = torch.zeros(8, 16, 1, 16), torch.zeros(8, 16, 1, 16)
    out = xqa(query, *caches, torch.zeros(3, 4, dtype=torch.int32), torch.tensor([5, 9, 60], dtype=torch.int32),
              0.25, k_scale=0.5, v_scale=0.125)
    ((dense, seen, seq_dtype, max_seq_len, scales),) = calls
    assert dense and torch.equal(seen, query) and seq_dtype == torch.uint32 and max_seq_len == 64
    assert (scales["bmm1_scale"], scales["bmm2_scale"], scales["enable_pdl"]) == (0.125, 0.125, False)
    assert scales["out"] is out and out.shape == query.shape


def test_xqa_builds_for_the_models_head_shape_by_one_call(monkeypatch):
    """The start-up build's call has the engine's head shape and page size, the shapes XQA compiles for."""
    from batchllm.ops import xqa_decode

    calls = []

    def kernel(query, caches, workspace, tables, seq_lens, max_seq_len, **scales):
        calls.append((query.shape, query.dtype, [c.shape for c in caches], caches[0].dtype, tables.tolist(),
                      seq_lens.view(torch.int32).tolist(), max_seq_len, scales["bmm1_scale"]))
        return scales["out"]

    monkeypatch.setattr(xqa_decode, "_xqa_kernel", lambda: kernel)
    xqa_decode.XqaDecode(torch.device("cpu"), workspace_bytes=64).build(32, 8, 128, 16)
    assert calls == [((1, 32, 128), torch.bfloat16, [(1, 16, 8, 128)] * 2, torch.float8_e4m3fn, [[0]], [1], 16,
                      128 ** -0.5)]


class _FakeXqa:
    """Records the backend's call and writes a marker output to `out`."""

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, query, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, out):
        self.calls.append((block_tables, seq_lens, scale, k_scale, v_scale, out))
        return out.fill_(7.0)


def _backend(xqa):
    from batchllm.engine.attention.triton_backend import TritonBackend

    return TritonBackend(16, 4, 2, 16, torch.device("cpu"), uses_groups=True, kv_fp8=True, xqa=xqa)


def test_only_steps_whose_rows_share_no_kv_attend_by_xqa():
    fake = _FakeXqa()
    lone = types.SimpleNamespace(shared_kv_lens=np.zeros(5, np.int32))
    sharing = types.SimpleNamespace(shared_kv_lens=np.array([0, 0, 37, 37, 0], np.int32))
    assert _backend(fake).decode_by_xqa(lone) and not _backend(fake).decode_by_xqa(sharing)
    assert not _backend(None).decode_by_xqa(lone)  # `fused`: never


def test_backend_attends_by_xqa_when_the_plan_carries_seq_lens():
    from batchllm.engine.attention.protocol import AttentionMetadata

    fake = _FakeXqa()
    backend = _backend(fake)
    query = torch.randn(3, 4, 16)
    tables, seq_lens = torch.arange(6, dtype=torch.int32).view(3, 2), torch.tensor([5, 17, 1], dtype=torch.int32)
    plan = types.SimpleNamespace(lead_seq_lens=seq_lens, block_tables=tables)
    metadata = AttentionMetadata(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), plan)
    out = torch.empty_like(query)
    got = backend.attend(query, None, None, metadata, 0.25, None, K_SCALE, V_SCALE, out)
    assert torch.equal(got, torch.full_like(query, 7.0))
    (call,) = fake.calls
    assert torch.equal(call[0], tables) and call[1] is seq_lens and call[2:5] == (0.25, K_SCALE, V_SCALE)
    assert call[5].data_ptr() == out.data_ptr() and call[5].shape == out.shape


def test_graph_plan_carries_each_rows_kv_positions():
    """A decode graph's static buffer holds the KV positions of the plan's lead rows (XQA's), 1 on
    its padding rows; the work list has no items for them."""
    from batchllm.attention_plan.layout import graph_layout
    from batchllm.attention_plan.tile_config import decode_tile_config
    from batchllm.attention_plan.work_list import WORK_FIELDS, build_prefix_shared_plan
    from batchllm.engine.graph_shapes import fill_decode_plan, graph_items_capacity, graph_slots_capacity

    b = make_batch([SeqSpec(1, n) for n in (40, 17, 33)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    meta = b.metadata_numpy()
    plan = build_prefix_shared_plan(**meta, block_size=16, num_kv_heads=2, num_heads=4, head_dim=16,
                                    tile=decode_tile_config(16, 2, interpret=True), num_sms=4, num_lead_rows=3)
    assert plan.work.shape[0] == 0
    rows = 8
    layout = graph_layout(rows, 4, graph_items_capacity(rows), graph_slots_capacity(rows), WORK_FIELDS)
    host = layout.views(np.full(layout.num_int32, -5, np.int32))
    fill_decode_plan(host, plan, plan.class_lists(), rows, 3)
    assert host["seq_lens"].tolist() == [40, 17, 33, 1, 1, 1, 1, 1]
    assert host["block_tables"][:3, :3].tolist() == meta["block_tables"][:, :3].tolist()


def _mixed_step():
    """Three decode rows of requests that share nothing, then a 20-token prompt chunk, a group's
    prefix chunk and a member's first chunk after it, and one more lone decode row: XQA takes the
    leading three."""
    from batchllm.sched.interface import ScheduledChunk, SchedulerOutput

    chunks = [ScheduledChunk(seq_id=i, token_ids=(5 + i,), start_position=20 + 9 * i, num_tokens=1,
                             new_block_ids=(4 * i, 4 * i + 1, 4 * i + 2), sample=True, is_decode=True)
              for i in range(3)]
    chunks.append(ScheduledChunk(seq_id=3, token_ids=tuple(range(100, 120)), start_position=0, num_tokens=20,
                                 new_block_ids=(20, 21), sample=True))
    chunks.append(ScheduledChunk(seq_id=-1, token_ids=tuple(range(50, 67)), start_position=0, num_tokens=17,
                                 new_block_ids=(30, 31), is_prefix=True, group_id=0))
    chunks.append(ScheduledChunk(seq_id=4, token_ids=(1, 2, 3), start_position=17, num_tokens=3,
                                 new_block_ids=(30, 31, 32), shared_kv_len=17, sample=True, group_id=0))
    chunks.append(ScheduledChunk(seq_id=5, token_ids=(9,), start_position=33, num_tokens=1,
                                 new_block_ids=(40, 41, 42), sample=True, is_decode=True))
    return SchedulerOutput(0, tuple(chunks))


@pytest.mark.skipif(torch.cuda.is_available(), reason="its backend runs Triton on CPU tensors: the interpreter's")
def test_leading_lone_rows_of_a_mixed_step_attend_by_xqa():
    """A step with prefill chunks: XQA (here the reference in its place) attends its leading rows
    that share nothing, the work list (which has no items for them) the rest; together they give
    the fused backend's output, and the plan hands XQA those rows' KV positions."""
    from batchllm.attention_plan.work_list import F_Q_START
    from batchllm.engine.attention.protocol import AttentionMetadata
    from batchllm.engine.step_inputs import build_step_inputs
    from batchllm.ops.plan_device import plan_to_device
    from test_engine_piecewise import _ReferenceXqa

    inputs = build_step_inputs(_mixed_step(), 16)
    xqa = _ReferenceXqa()
    with_xqa, plain = _backend(xqa), _backend(None)
    assert with_xqa.xqa_rows(inputs) == 3 and plain.xqa_rows(inputs) == 0
    plan = with_xqa.build_plan(inputs)
    assert plan.lead_seq_lens.tolist() == [21, 30, 39]
    assert plan.work[:, F_Q_START].min() >= 3
    torch.manual_seed(0)
    query = torch.randn(inputs.num_tokens, 4, 16)
    k_cache, v_cache = torch.randn(64, 16, 2, 16), torch.randn(64, 16, 2, 16)
    positions = torch.as_tensor(inputs.positions)

    def attend(backend, host_plan):
        metadata = AttentionMetadata(torch.as_tensor(inputs.slot_mapping), positions,
                                     plan_to_device(host_plan, torch.device("cpu")))
        return backend.attend(query, k_cache, v_cache, metadata, 0.25)

    expected = attend(plain, plain.build_plan(inputs))
    got = attend(with_xqa, plan)
    assert xqa.num_calls == 1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_planner_refuses_lead_rows_that_are_not_lone_rows():
    from batchllm.attention_plan.work_list import build_prefix_shared_plan
    from batchllm.engine.step_inputs import build_step_inputs

    inputs = build_step_inputs(_mixed_step(), 16)
    args = (inputs.query_start_loc, inputs.seq_lens, inputs.shared_kv_lens, inputs.block_tables)
    with pytest.raises(ValueError, match="lead rows must be one row per seq"):
        build_prefix_shared_plan(*args, block_size=16, num_kv_heads=2, num_heads=4, head_dim=16, num_sms=4,
                                 num_lead_rows=4)


needs_xqa = pytest.mark.skipif(not (HAS_FLASHINFER and _hopper()), reason="needs FlashInfer and a Hopper GPU")


@pytest.mark.gpu
@needs_xqa
def test_xqa_kernel_matches_the_reference_gpu():
    """Llama-3.1-8B heads on an FP8 cache with scales that are not powers of two, in a CUDA graph:
    XQA rounds the query and the probabilities to e4m3, so it is held to a bf16-FP8 tolerance."""
    from batchllm.ops.kv_quant import quantize_e4m3
    from batchllm.ops.reference import paged_attention_reference
    from batchllm.ops.xqa_decode import XqaDecode

    seqs = [SeqSpec(1, 1 + 97 * i) for i in range(24)]
    b = make_batch(seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16,
                   device="cuda")
    k8, v8 = quantize_e4m3(b.k_cache, K_SCALE), quantize_e4m3(b.v_cache, V_SCALE)
    scale = 128 ** -0.5
    ref = paged_attention_reference(b.query.float(), k8, v8, b.query_start_loc, b.seq_lens, b.shared_kv_lens,
                                    b.block_tables, scale, k_scale=K_SCALE, v_scale=V_SCALE)
    xqa = XqaDecode(torch.device("cuda"))
    out = torch.empty_like(b.query)
    capture_and_replay(lambda: xqa(b.query, k8, v8, b.block_tables, b.seq_lens, scale, K_SCALE, V_SCALE, out))
    error = (out.float() - ref).abs()
    assert error.max() < 0.06 and error.mean() < 6e-3, (error.max(), error.mean())


def _engines_and_steps():
    """The same random model and FP8 cache under `xqa` and `fused`, and three steps: a decode step
    of requests that share nothing (XQA takes every row), a decode step with a group prefix (the work
    list takes every row) and a step with prefill chunks whose leading decode rows XQA takes."""
    from batchllm import LLM
    from batchllm.sched.interface import ScheduledChunk, SchedulerOutput
    from test_engine_cuda_graphs import MODEL, _decode_step, _random_cache

    engines = {name: LLM(model=MODEL, kv_cache_tokens=8192, attention_backend=name, kv_cache_dtype="fp8")
               for name in ("xqa", "fused")}
    for llm in engines.values():
        _random_cache(llm, k_scale=K_SCALE, v_scale=V_SCALE)  # the same values in both
    lone = SchedulerOutput(0, tuple(
        ScheduledChunk(seq_id=i, token_ids=(5 + i,), start_position=40 + 29 * i, num_tokens=1,
                       new_block_ids=tuple(range(20 * i, 20 * i + 4 + 2 * i)), sample=True, is_decode=True)
        for i in range(9)))
    steps = ((lone, True), (_decode_step(16), False), (_mixed_step(), None))
    return engines["xqa"].engine.runner, engines["fused"].engine.runner, steps


@pytest.mark.gpu
@needs_xqa
def test_engine_xqa_rows_reach_the_kernel_as_the_fused_backend_reads_them_gpu():
    """With the reference in XQA's place, the xqa engine's eager steps give the fused backend's
    hidden states to bf16 rounding: the rows, block tables, KV positions and scales it hands the
    kernel are the ones the work list reads."""
    from batchllm.engine.step_inputs import build_step_inputs
    from test_engine_piecewise import _ReferenceXqa

    xqa, fused, steps = _engines_and_steps()
    xqa.backend.xqa = reference = _ReferenceXqa()
    for step, by_xqa in steps:
        inputs = build_step_inputs(step, 16)
        expected = fused.forward(inputs, allow_graph=False).float().clone()
        if by_xqa is not None:
            assert xqa.graphs.key_for(inputs, xqa.backend.build_plan(inputs)).xqa is by_xqa
        torch.testing.assert_close(xqa.forward(inputs, allow_graph=False).float(), expected, atol=6e-2, rtol=6e-2)
    assert reference.num_calls == 2 * 2  # two layers of the lone step and of the mixed one


@pytest.mark.gpu
@needs_xqa
def test_engine_xqa_steps_stay_near_the_fused_backend_gpu():
    """The real kernel, eagerly and in the engine's graphs. XQA's e4m3 rounding of the query and the
    probabilities (up to 0.06 per attention output, test_xqa_kernel_matches_the_reference_gpu)
    grows through the two random layers: on the H200 the decode step that XQA takes whole was 0.35
    off at most and 0.051 on average (6.4% of the hidden states' mean magnitude, 0.80), the step
    with prefill chunks 0.24 and 0.7%, and the group decode step, which XQA does not take, 0.03
    and 0.04%. Bounds per step kind: (largest difference, mean difference over mean magnitude)."""
    from batchllm.engine.step_inputs import build_step_inputs

    bounds = {True: (0.6, 0.1), None: (0.6, 0.02), False: (0.1, 0.005)}  # by_xqa: XQA takes all, some, none
    xqa, fused, steps = _engines_and_steps()
    for step, by_xqa in steps:
        inputs = build_step_inputs(step, 16)
        expected = fused.forward(inputs, allow_graph=False).float().clone()
        eager = xqa.forward(inputs, allow_graph=False).float().clone()
        graphed = xqa.forward(inputs).float().clone()
        assert xqa.last_mode == ("graph_replay" if by_xqa is not None else "piecewise")
        max_bound, relative_bound = bounds[by_xqa]
        for got in (eager, graphed):
            error = (got - expected).abs()
            relative = error.mean() / expected.abs().mean()
            assert error.max() < max_bound and relative < relative_bound, (by_xqa, error.max(), relative)
    assert {key.xqa for key in xqa.graphs.graphs} == {True, False}


@pytest.mark.gpu
@needs_xqa
def test_auto_runs_xqa_on_an_fp8_cache_and_fused_on_a_bf16_one_gpu():
    from batchllm import LLM
    from test_engine_cuda_graphs import MODEL

    for kv_cache_dtype, expected in (("fp8", "xqa"), ("auto", "fused")):
        runner = LLM(model=MODEL, kv_cache_tokens=8192, kv_cache_dtype=kv_cache_dtype).engine.runner
        assert runner.attention_backend == expected
        assert (runner.backend.xqa is not None) is (expected == "xqa")
