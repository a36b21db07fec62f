"""The engine configuration: one frozen tree, built once from the command line or `LLM(...)`, and
refused (one line, exit 2, nothing written) when this machine cannot run it, before the model loads."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from batchllm.cli.main import main
from batchllm.config import CacheConfig, EngineConfig, ParallelConfig, RayDPConfig, TensorParallelConfig, engine_config
from batchllm.engine.errors import EngineConfigError
from batchllm.sched.config import SchedulerConfig

pytest_plugins = ["model_fixtures"]

MISSING_MODEL = "/nonexistent/model.gguf"  # a refusal must come before the model would load
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")


def _run(capsys, tmp_path, *options) -> tuple[int, list[str]]:
    """`batchllm run` in this process on a one-line input; (exit code, stderr lines)."""
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 2}) + "\n")
    code = main(["run", str(source), "-o", str(tmp_path / "out.jsonl"), "--no-progress", *map(str, options)])
    return code, capsys.readouterr().err.splitlines()


def test_the_flat_options_build_one_frozen_tree():
    config = engine_config("random:tiny", device="cpu", kv_cache_tokens=4096, kv_cache_dtype="auto", policy="vllm",
                           block_size=8, max_num_batched_tokens=256, max_num_seqs=32, tensor_parallel_size=2,
                           gpu_memory_utilization=0.5, seed=7)
    assert config == EngineConfig(
        model="random:tiny", device="cpu", seed=7,
        cache=CacheConfig(kv_cache_tokens=4096, gpu_memory_utilization=0.5),
        scheduler=SchedulerConfig(policy="vllm", block_size=8, max_num_batched_tokens=256, max_num_seqs=32),
        parallel=ParallelConfig(tensor=TensorParallelConfig(size=2)))
    assert engine_config(ray_num_replicas=3).parallel == ParallelConfig(ray=RayDPConfig(num_replicas=3))
    for node in (config, config.cache, config.scheduler, config.parallel, config.parallel.tensor):
        with pytest.raises(dataclasses.FrozenInstanceError):
            node.seed = 1  # any field: frozen


@pytest.mark.parametrize("options,message", [
    (dict(device="banana"), "device must be auto, cpu, cuda or cuda:N, got 'banana'"),
    (dict(device="cuda:x"), "device must be auto, cpu, cuda or cuda:N, got 'cuda:x'"),
    (dict(attention_backend="flash"), "attention_backend must be one of auto, reference, torch, triton, fused, xqa, "
                                      "got 'flash'"),
    (dict(kv_cache_tokens=8), "--kv-cache-tokens 8 is less than one KV block (--block-size 16): give at least 16"),
    (dict(tensor_parallel_size=2, ray_num_replicas=2), "--tensor-parallel-size > 1 does not work with --ray (each "
                                                       "replica runs one unsplit engine): drop one of them"),
    (dict(tensor_parallel_size=2, kv_cache_dtype="fp8"), "--quantization and --kv-cache-dtype fp8 run on one GPU; "
                                                         "with --tensor-parallel-size 2 the model runs in bf16 (drop "
                                                         "the FP8 flags)"),
    (dict(ray_num_replicas=0), "--num-replicas must be >= 1, got 0"),
])
def test_a_bad_configuration_is_refused_when_it_is_built(options, message):
    with pytest.raises(ValueError) as error:
        engine_config(MISSING_MODEL, **options)
    assert str(error.value) == message


def test_device_banana_exits_2_before_the_model_loads(capsys, tmp_path):
    code, err = _run(capsys, tmp_path, "--model", MISSING_MODEL, "--device", "banana")
    assert (code, err) == (2, ["error: device must be auto, cpu, cuda or cuda:N, got 'banana'"])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.jsonl"]


@no_cuda
def test_device_cuda_without_a_gpu_exits_2_before_the_model_loads(capsys, tmp_path):
    code, err = _run(capsys, tmp_path, "--model", MISSING_MODEL, "--device", "cuda")
    assert (code, err) == (2, ["error: --device cuda: this machine has no CUDA GPU that PyTorch can use (fix: "
                               "--device cpu, or auto)"])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.jsonl"]
    with pytest.raises(EngineConfigError, match="no CUDA GPU"):
        from batchllm import LLM

        LLM(MISSING_MODEL, device="cuda:1")


@no_cuda
@pytest.mark.parametrize("backend", ["triton", "fused"])
def test_triton_backends_on_the_cpu_exit_2_before_the_model_loads(capsys, tmp_path, monkeypatch, backend):
    """Without Triton's interpreter (which the tests turn on) the kernels cannot run on a CPU: every
    request would fail; the run is refused instead."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    code, err = _run(capsys, tmp_path, "--model", MISSING_MODEL, "--attention-backend", backend)
    assert (code, err) == (2, [f"error: --attention-backend {backend} runs Triton kernels, which need a CUDA GPU "
                               "(fix: --attention-backend torch, or auto, on the CPU)"])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.jsonl"]
    with pytest.raises(EngineConfigError, match="need a CUDA GPU"):
        from batchllm import LLM

        LLM(MISSING_MODEL, device="cpu", attention_backend=backend)


def test_a_kv_cache_larger_than_free_memory_exits_2_naming_the_most_that_fits(capsys, tmp_path, monkeypatch):
    """random:tiny holds 512 bytes of K and V a token in float32 (2 layers, 2 KV heads, 16 dims)."""
    import batchllm.engine.kv_cache as kv_cache

    monkeypatch.setattr(kv_cache, "free_memory_bytes", lambda device: 64 << 20)
    code, err = _run(capsys, tmp_path, "--model", "random:tiny", "--device", "cpu", "--kv-cache-tokens", 100_000_000)
    assert code == 2
    assert err[-1] == ("error: --kv-cache-tokens 100000000 needs 47.7 GiB of KV cache and cpu has 0.1 GiB free: "
                       "give at most 131072 (or leave it out for the default size)")
    code, _ = _run(capsys, tmp_path, "--model", "random:tiny", "--device", "cpu", "--kv-cache-tokens", 131072,
                   "--overwrite")
    assert code == 0  # exactly what fits runs


def test_a_kv_cache_beyond_any_memory_is_refused_on_this_host(capsys, tmp_path):
    code, err = _run(capsys, tmp_path, "--model", "random:tiny", "--device", "cpu", "--kv-cache-tokens", 10 ** 14)
    assert code == 2 and len(err) == 2 and err[0].startswith("loading model random:tiny")
    assert err[1].startswith("error: --kv-cache-tokens 100000000000000 needs 47683715.8 GiB of KV cache and cpu has ")
    assert err[1].endswith(" (or leave it out for the default size)")


def test_configure_scheduler_replaces_the_frozen_tree(tiny_engine):
    before = tiny_engine.config
    tiny_engine.configure_scheduler(policy="sglang", max_num_batched_tokens=128)
    assert tiny_engine.config == dataclasses.replace(
        before, scheduler=dataclasses.replace(before.scheduler, policy="sglang", max_num_batched_tokens=128))
    # the KV blocks are the engine's state (its cache's), not configuration
    assert tiny_engine.scheduler_config.num_kv_blocks == tiny_engine.kv_cache.num_blocks == 4096 // 16
    with pytest.raises(ValueError, match="num_kv_blocks and block_size belong to the KV cache"):
        tiny_engine.configure_scheduler(num_kv_blocks=3)


def test_an_engine_of_one_device_refuses_a_parallel_configuration():
    from batchllm.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="build its engine with batchllm.engines.build_engine"):
        LLMEngine(engine_config(MISSING_MODEL, tensor_parallel_size=2))


@pytest.mark.parametrize("options,message", [
    (["--device", "banana"], "error: device must be auto, cpu, cuda or cuda:N, got 'banana'"),
    (["--device", "banana", "--quantization", "fp8"], "error: device must be auto, cpu, cuda or cuda:N, got 'banana'"),
    (["--kv-cache-tokens", "8"], "error: --kv-cache-tokens 8 is less than one KV block (--block-size 16): give at "
                                 "least 16"),
])
def test_bench_refuses_an_engine_it_cannot_build_before_loading(capsys, tmp_path, options, message):
    code = main(["bench", "--model", MISSING_MODEL, "--workload", "micro:8:4:2", "--requests", "4",
                 "--output-tokens", "2", "--out", str(tmp_path / "r.json"), *options])
    assert (code, capsys.readouterr().err.splitlines()) == (2, [message])
    assert not list(tmp_path.iterdir())


def test_llm_takes_engine_config_options_with_the_same_defaults():
    # LLM(...) spells out engine_config's options for its signature; their defaults must agree.
    import inspect

    from batchllm.config import engine_config
    from batchllm.llm import LLM

    built = inspect.signature(engine_config).parameters
    for name, parameter in inspect.signature(LLM.__init__).parameters.items():
        if name in ("self",):
            continue
        assert name in built, name
        assert parameter.default == built[name].default, name


@pytest.mark.parametrize("argv", [["run", "in.jsonl", "-o", "out.jsonl"], ["bench"], ["simulate", "in.jsonl"]])
def test_every_command_defaults_to_the_one_token_budget(argv):
    # The step's token budget has one default (measured: BENCHMARKS.md, "Token budget"); the
    # commands, LLM(...) and the configuration tree all take it from there.
    from batchllm.cli.main import build_parser
    from batchllm.sched.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

    assert build_parser().parse_args(argv).max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert engine_config().scheduler.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert SchedulerConfig().max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS == 8192


@pytest.mark.parametrize("argv", [["run", "in.jsonl", "-o", "out.jsonl"], ["bench"]])
def test_every_command_defaults_to_the_one_memory_share(argv):
    # The share of GPU memory the engine fills has one default; the commands, LLM(...) and the
    # configuration tree take it from there, and bench passes a chosen share to its engines.
    from batchllm.cli.bench import options_from_args
    from batchllm.cli.main import build_parser
    from batchllm.config import DEFAULT_GPU_MEMORY_UTILIZATION
    from batchllm.perf.runner import engine_options

    assert build_parser().parse_args(argv).gpu_memory_utilization == DEFAULT_GPU_MEMORY_UTILIZATION == 0.90
    assert engine_config().cache.gpu_memory_utilization == DEFAULT_GPU_MEMORY_UTILIZATION
    chosen = build_parser().parse_args(["bench", "--gpu-memory-utilization", "0.95"])
    assert engine_options(options_from_args(chosen, "random:tiny"))["gpu_memory_utilization"] == 0.95
