"""The engine gives the same greedy tokens with every attention backend (Triton interpreted on CPU)."""

import pytest

from batchllm import LLM, SamplingParams
from batchllm.perf.workloads import micro_workload

MODEL = "random:tiny?vocab_size=4096"


@pytest.fixture(scope="module")
def prompts():
    workload = micro_workload(24, 8, 3, num_requests=6, output_num_tokens=4, vocab_size=4096, seed=3)
    return [p.tolist() for p in workload.prompts]


def _run(backend: str, policy: str, prompts, device: str, fused_kernels: bool = False):
    llm = LLM(model=MODEL, dtype="float32", device=device, attention_backend=backend, policy=policy,
              max_num_batched_tokens=64, kv_cache_tokens=2048, fused_kernels=fused_kernels)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.last_run_stats


@pytest.mark.parametrize("backend,policy,fused_kernels", [
    ("fused", "batchllm", True), ("fused", "batchllm", False), ("triton", "vllm", False), ("reference", "batchllm", False),
])
def test_backends_agree_with_the_torch_path(prompts, device, backend, policy, fused_kernels):
    expected, _ = _run("torch", policy, prompts, device)
    got, stats = _run(backend, policy, prompts, device, fused_kernels)
    assert got == expected
    assert all(len(tokens) == 4 for tokens in got)
    if policy == "batchllm":
        # the planner's groups were used: some steps carried common-prefix tokens
        assert sum(step.num_prefix_tokens for step in stats.step_records) == 2 * 24
