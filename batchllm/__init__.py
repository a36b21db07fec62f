"""batchllm: offline, throughput-oriented batched LLM inference with global prefix sharing.

The heavy parts (torch, transformers) load lazily so that `batchllm.prefix`, `batchllm.sched`
and the `analyze` / `simulate` commands work without importing torch.
"""

from batchllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from batchllm.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from batchllm import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'batchllm' has no attribute {name!r}")
