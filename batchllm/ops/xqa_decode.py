"""Decode attention on an FP8 KV cache by XQA, TensorRT-LLM's decode kernel as FlashInfer ships it
(`flashinfer.decode.xqa_batch_decode_with_kv_cache`, compiled on first use).

The `xqa` attention backend (engine/attention/select.py) runs it for the decode rows that share no KV
(TritonBackend.xqa_rows): every row of such a decode step (its CUDA graph), and the leading decode
rows of a step with prefill chunks, beside the work list's launches. Each row reads its own block
table, as XQA's paged layout wants; a row with a shared prefix keeps the work-list kernels, which
read the prefix once for the whole group. Why not
our own kernel there: on the H200, decode steps of 600 and 1,700 rows over about 1,200 and 1,000
FP8 positions ran at 4.01 and 4.12 TB/s of cache on XQA against 2.84 on the work-list kernel, whose
decode tiles pad 4 GQA query heads to 16 MMA rows and convert every e4m3 value to float16 (docs/design.md,
"Decode attention by XQA"). XQA runs its products in FP8 (the query and the probabilities rounded to
e4m3): its output is about ten times further from the bf16 kernels' than the work-list FP8 row's.

GPU only; FlashInfer is an optional dependency (`pip install 'batchllm[xqa]'`)."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from batchllm.ops.kv_quant import is_fp8

# Scratch of XQA's multi-block mode, and its semaphores (the first 8 MiB, zeroed once).
WORKSPACE_BYTES = 256 * 2**20
PAGE_SIZES = (16, 32, 64, 128)
HEAD_DIMS = (64, 128, 256)
INSTALL_HINT = ("pip install flashinfer-python, or batchllm[xqa] (FlashInfer compiles the kernel on first use: nvcc "
                "must be on PATH)")


def xqa_installed() -> bool:
    """Whether FlashInfer is importable here (it is not on a CPU install)."""
    return importlib.util.find_spec("flashinfer") is not None


def _xqa_kernel():
    """flashinfer's XQA entry point, or an error that says how to install it."""
    try:
        return importlib.import_module("flashinfer.decode").xqa_batch_decode_with_kv_cache
    except (ImportError, AttributeError) as error:
        raise RuntimeError(f"the xqa attention backend needs FlashInfer's XQA kernel ({error}): "
                           f"{INSTALL_HINT}") from error


def check_xqa_supported(device: torch.device, kv_cache_dtype: torch.dtype | None, block_size: int, head_dim: int,
                        layer_windows: tuple[int | None, ...]) -> None:
    """Raise ValueError naming what stands in the way of XQA decode attention on this engine."""
    if device.type != "cuda":
        raise ValueError(f"the xqa attention backend runs on a CUDA GPU, not on {device.type}")
    if torch.cuda.get_device_capability(device) < (9, 0):
        raise ValueError("the xqa attention backend needs a Hopper GPU or newer (compute capability 9.0)")
    if kv_cache_dtype is None or not is_fp8(kv_cache_dtype):
        raise ValueError("the xqa attention backend runs FP8 KV caches: add --kv-cache-dtype fp8")
    if block_size not in PAGE_SIZES:
        raise ValueError(f"the xqa attention backend takes KV blocks of {PAGE_SIZES} tokens, not {block_size}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the xqa attention backend takes heads of {HEAD_DIMS} dimensions, not {head_dim}")
    if any(window is not None for window in layer_windows):
        raise ValueError("the xqa attention backend does not run models with a sliding window")


class XqaDecode:
    """XQA over one engine's FP8 caches: holds the kernel's workspace (one per engine, reused by
    every layer and every graph: the layers run one after another on one stream)."""

    def __init__(self, device: torch.device, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self._kernel = _xqa_kernel()
        self.device = device
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)

    def build(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype = torch.bfloat16) -> None:
        """Build (or load from FlashInfer's cache) the kernel for this head shape now, by one call
        on a one-block cache, rather than inside the first graph capture; raises what the build
        raises (no nvcc, for one)."""
        query = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=self.device)
        cache = torch.zeros(1, block_size, num_kv_heads, head_dim, dtype=torch.float8_e4m3fn, device=self.device)
        block_tables = torch.zeros(1, 1, dtype=torch.int32, device=self.device)
        seq_lens = torch.ones(1, dtype=torch.int32, device=self.device)
        self(query, cache, cache, block_tables, seq_lens, head_dim ** -0.5)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0,
                 v_scale: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
        """Row i ([num_rows, num_heads, head_dim]) attends positions [0, seq_lens[i]) of the
        float8_e4m3fn caches ([num_blocks, block_size, num_kv_heads, head_dim]) through block
        table row i (int32; position p in block p // block_size); seq_lens: [num_rows] int32, at
        least 1. out: shaped like query, contiguous (None: a new tensor)."""
        # XQA reads the query densely from its first element: the model's query is a view into
        # its QKV projection's rows (a row stride of q + k + v heads), so it is copied here
        query = query.contiguous()
        out = torch.empty_like(query) if out is None else out
        max_seq_len = block_tables.shape[1] * k_cache.shape[1]
        # XQA scales q.k by bmm1_scale and the output by bmm2_scale: the caches' scales fold in there
        return self._kernel(query, (k_cache, v_cache), self.workspace, block_tables, seq_lens.view(torch.uint32),
                            max_seq_len, bmm1_scale=float(scale) * float(k_scale), bmm2_scale=float(v_scale),
                            out=out, enable_pdl=False)
