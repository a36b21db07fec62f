"""benchmarks/host_profile.py: profiled functions land in the right category, and the per-step
summary adds up."""

import cProfile
import json
import pstats

import torch
from script_loader import load_benchmark_script

host_profile = load_benchmark_script("host_profile.py")


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
    assert {key: host_profile.category(*key) for key in cases} == cases


def test_summary_per_step_adds_up():
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        torch.nn.functional.linear(torch.ones(64, 64), torch.ones(64, 64)).sum()
    profiler.disable()
    summary = host_profile.summarize(pstats.Stats(profiler), num_steps=4, top=50)
    per_category = summary["category_ms_per_step"]
    assert per_category["torch_builtin_ops"] > 0
    assert abs(sum(per_category.values()) - summary["profiled_ms_per_step"]) < 0.01 * len(per_category) + 1e-9
    linear = [f for f in summary["top_functions"] if "_nn.linear" in f["function"]]
    assert len(linear) == 1 and linear[0]["calls_per_step"] == 5.0  # 20 calls over 4 steps
    assert linear[0]["category"] == "torch_builtin_ops"
    assert host_profile.summarize(pstats.Stats(profiler), num_steps=4, top=2)["top_functions"][1:2]


def test_run_on_a_tiny_model_profiles_every_step(tmp_path, monkeypatch):
    out = tmp_path / "host_profile.json"
    monkeypatch.setattr("sys.argv", ["host_profile.py", "--model", "random:tiny?vocab_size=4096",
                                     "--workload", "micro:64:8:4", "--requests", "8", "--output-tokens", "3",
                                     "--top", "5", "--out", str(out)])
    assert host_profile.main() == 0
    result = json.loads(out.read_text())
    steps = result["profiled_run"]["all"]["steps"]
    assert steps == result["plain_run"]["all"]["steps"] > 0
    kinds = result["execute_profile"]
    assert sum(kind["steps"] for kind in kinds.values()) == steps  # one execute call a step
    if not torch.cuda.is_available():  # no CUDA graphs: every step is eager
        assert list(kinds) == ["eager"]
    eager = kinds["eager"]  # the first step has prefill chunks
    assert eager["profiled_ms_per_step"] > 0 and len(eager["top_functions"]) == 5
    assert result["requests"] == 8 and result["kv_cache_dtype"] == "auto"
