"""batchllm/perf/host_profile.py: profiled functions land in the right category, the per-step
summary adds up, and the profiler as the runner's step observer counts every step."""

import cProfile
import pstats

import torch

from batchllm.engine.request_state import PreparedRequest, RunStats
from batchllm.perf.host_profile import HostProfiler, category, summarize
from batchllm.sampling_params import SamplingParams

pytest_plugins = ["model_fixtures"]  # tiny_engine


def test_categories():
    cases = {
        ("~", "<method 'synchronize' of 'torch._C._CudaEventBase' objects>"): "gpu_wait",
        ("/venv/lib/python3.12/site-packages/triton/runtime/jit.py", "run"): "triton_launcher",
        ("~", "<built-in method torch._C._nn.linear>"): "torch_builtin_ops",
        ("/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", "_call_impl"): "torch_python",
        ("/repo/batchllm/attention_plan/work_list.py", "build_prefix_shared_plan"): "attention_plan",
        ("/repo/batchllm/attention_plan/dense_calls.py", "cut_dense_calls"): "attention_plan",
        ("/repo/batchllm/ops/prefix_attention.py", "_validate"): "batchllm_ops",
        ("/repo/batchllm/models/llama.py", "forward"): "batchllm_models",
        ("/repo/batchllm/engine/step_inputs.py", "build_step_inputs"): "batchllm_engine",
        ("~", "<method 'astype' of 'numpy.ndarray' objects>"): "numpy",
        ("~", "<built-in method builtins.len>"): "python_builtins",
        ("/usr/lib/python3.12/dataclasses.py", "replace"): "other",
    }
    assert {key: category(*key) for key in cases} == cases


def test_summary_per_step_adds_up():
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        torch.nn.functional.linear(torch.ones(64, 64), torch.ones(64, 64)).sum()
    profiler.disable()
    summary = summarize(pstats.Stats(profiler), num_steps=4, top=50)
    per_category = summary["category_ms_per_step"]
    assert per_category["torch_builtin_ops"] > 0
    assert abs(sum(per_category.values()) - summary["profiled_ms_per_step"]) < 0.01 * len(per_category) + 1e-9
    linear = [f for f in summary["top_functions"] if "_nn.linear" in f["function"]]
    assert len(linear) == 1 and linear[0]["calls_per_step"] == 5.0  # 20 calls over 4 steps
    assert linear[0]["category"] == "torch_builtin_ops"
    assert len(summarize(pstats.Stats(profiler), num_steps=4, top=2)["top_functions"]) == 2


def test_profiler_as_step_observer_profiles_every_step(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    requests = [PreparedRequest(i, [5, 6, 7, 8, 9 + i], params) for i in range(4)]
    profiler, stats = HostProfiler(), RunStats()
    tiny_engine.runner.observer = profiler
    try:
        list(tiny_engine.run(requests, stats=stats))
    finally:
        tiny_engine.runner.observer = None
    assert profiler.num_steps == {"eager": 3} == {"eager": stats.num_steps}  # no CUDA graphs on the CPU
    summary = profiler.summary(top=5)
    assert list(summary) == ["eager"] and summary["eager"]["steps"] == 3
    assert summary["eager"]["profiled_ms_per_step"] > 0 and len(summary["eager"]["top_functions"]) == 5
    functions = " ".join(f["function"] for f in summarize(profiler.stats["eager"], 3, top=10_000)["top_functions"])
    assert "build_step_inputs" in functions  # the step's input building is inside the profiled launch
