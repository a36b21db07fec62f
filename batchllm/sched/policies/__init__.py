"""Scheduling policies: `batchllm` (BatchLLM 4.3) and the `vllm` / `sglang` baselines."""
