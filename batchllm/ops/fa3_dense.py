"""A step's dense calls (attention_plan/dense_calls.py) in FP8 products on Hopper: FlashInfer's FA3
FP8 ragged prefill kernel (`BatchPrefillWithRaggedKVCacheWrapper`, backend "fa3", compiled on
first use), as TensorRT-LLM runs the context attention of an FP8 KV cache. The query rows go to
e4m3 with a scale per head (ops/query_fp8.py), K and V stay the cache's e4m3 values with its
scales, and the probabilities are rounded to e4m3 inside the kernel.

Why: on the H200, one layer's 3 causal squares of 5,000 rows took 0.85 ms on it against 1.08 on
cuDNN's bf16 kernel (padded to 5,120 rows), 856 against 622 TFLOP/s for one square of 16,384; it
takes any lengths in one launch (no padded rows, no execution plan per new shape), so a step's
causal calls of every size run in one launch, and its bottom-right mask lets a chunk's causal call
hold the chunk's context too (TileConfig.dense_causal_whole). The cost is accuracy: its outputs
are about 25 times further from a float32 reference than cuDNN's bf16 ones (mean absolute error
0.0065 against 0.00026 on outputs of mean magnitude 0.15), the error XQA's decode rows already
have.

Per step (Fa3Dense.prepare, on the host, once for every layer): the calls in two ragged batches,
the unmasked ones and the causal ones (each square of a batched call one entry), their query
rows and an FA3 plan each. Per layer (Fa3DenseStep.__call__): the rows quantized, each call's KV
gathered from the cache unconverted (ops/kv_gather.py), one FA3 launch per batch, then every
call's rows stored to the output or to their partial slots (ops/dense_store.py; FA3's
log-sum-exp is in base 2 already).

GPU only (compute capability 9.0); FlashInfer is the optional dependency that XQA also needs. The
kernel's float32 reference (tests/op_references.py, RaggedFp8PrefillReference) takes a planned
wrapper's place in Fa3DenseStep, so that the CPU tests run everything around it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np
import torch

from batchllm.ops.dense_store import store_dense_output
from batchllm.ops.kv_gather import gather_dense_kv
from batchllm.ops.plan_device import DenseCall
from batchllm.ops.query_fp8 import quantize_query
from batchllm.ops.transfer import Upload, to_device

FP8 = torch.float8_e4m3fn
WORKSPACE_BYTES = 128 * 2**20
HEAD_DIMS = (64, 128, 256)
# each step plans into the next of these wrapper slots: FlashInfer copies a plan to the device from
# one pinned buffer per wrapper, so a slot is planned again only once its last copy has run
NUM_SLOTS = 2


@dataclass(frozen=True)
class RaggedBatch:
    """Dense calls of one mask in one FA3 launch: entry i has qo_lens[i] query rows and kv_lens[i]
    KV positions (a causal entry at least as many as its rows, under the bottom-right mask); the
    calls' rows follow one another in the batch's rows from row_offset (rows of the step's
    query, in call order)."""

    calls: tuple[DenseCall, ...]
    causal: bool
    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    row_offset: int  # first row of this batch in the step's quantized rows

    @property
    def num_rows(self) -> int:
        return sum(self.qo_lens)

    @property
    def num_kv(self) -> int:
        return sum(self.kv_lens)


def ragged_batches(calls: tuple[DenseCall, ...]) -> tuple[list[RaggedBatch], np.ndarray]:
    """The unmasked calls, then the causal ones, as ragged batches (none for a mask with no call),
    and the step's query rows they read, in batch order ([num_rows] int32)."""
    batches, rows, offset = [], [], 0
    for causal in (False, True):
        chosen = tuple(call for call in calls if call.causal == causal)
        if not chosen:
            continue
        qo_lens, kv_lens = [], []
        for call in chosen:
            entry_rows = call.q_count // call.batch
            qo_lens += [entry_rows] * call.batch
            kv_lens += [call.kv_len] * call.batch
            rows.append(np.arange(call.q_start, call.q_start + call.q_count, dtype=np.int32))
        batch = RaggedBatch(chosen, causal, tuple(qo_lens), tuple(kv_lens), offset)
        batches.append(batch)
        offset += batch.num_rows
    return batches, (np.concatenate(rows) if rows else np.zeros(0, np.int32))


def _indptr(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


class Fa3DenseStep:
    """One step's dense calls on FA3 (Fa3Dense.prepare); called once per layer."""

    def __init__(self, batches: list[RaggedBatch], wrappers: list, rows: torch.Tensor) -> None:
        self.batches, self.wrappers, self.rows = batches, wrappers, rows

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 part_out: torch.Tensor, part_lse: torch.Tensor, scale: float, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        """Every dense call's rows to the output (partial_base < 0) or to their partial slots with
        their base-2 log-sum-exps (what ops/prefix_attention.run_dense_calls writes). scale: the
        softmax scale, folded into the query's per-head scales (the plans' own is 1)."""
        q8, q_scale = quantize_query(query, self.rows)
        q_scale.mul_(float(scale))
        num_kv_heads, head_dim = k_cache.shape[2:]
        for batch, wrapper in zip(self.batches, self.wrappers):
            key = torch.empty((batch.num_kv, num_kv_heads, head_dim), dtype=FP8, device=query.device)
            value = torch.empty_like(key)
            start = 0
            for call in batch.calls:
                positions = call.batch * call.kv_len
                views = tuple(t[start:start + positions].view(call.batch, call.kv_len, num_kv_heads, head_dim)
                              for t in (key, value))
                gather_dense_kv(k_cache, v_cache, call.blocks, call.batch, call.offset, call.kv_len, call.kv_len,
                                FP8, out=views)
                start += positions
            rows = slice(batch.row_offset, batch.row_offset + batch.num_rows)
            o, lse = wrapper.run(q8[rows], key, value, q_scale, float(k_scale), float(v_scale), return_lse=True)
            start = 0
            for call in batch.calls:
                o_call = o[start:start + call.q_count].unsqueeze(0)
                if call.partial_base < 0:
                    store_dense_output(o_call, None, out[call.q_start:call.q_start + call.q_count], None)
                else:
                    slots = slice(call.partial_base, call.partial_base + call.q_count)
                    store_dense_output(o_call, lse[start:start + call.q_count].unsqueeze(0), part_out[slots],
                                       part_lse[slots], lse_scale=1.0)
                start += call.q_count


class Fa3Dense:
    """FA3's FP8 prefill over one engine's heads: its workspace and wrapper slots."""

    def __init__(self, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int,
                 out_dtype: torch.dtype = torch.bfloat16) -> None:
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"FA3's FP8 prefill takes heads of {HEAD_DIMS} dimensions, not {head_dim}")
        prefill = importlib.import_module("flashinfer.prefill")
        self.device, self.num_heads, self.num_kv_heads, self.head_dim = device, num_heads, num_kv_heads, head_dim
        self.out_dtype = out_dtype
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        make = prefill.BatchPrefillWithRaggedKVCacheWrapper
        # per slot, one wrapper per mask (unmasked, causal): the two batches of one step
        self._slots = [[make(workspace, "NHD", backend="fa3") for _ in range(2)] for _ in range(NUM_SLOTS)]
        self._planned = [None] * NUM_SLOTS  # the event after each slot's last plan copy
        self._next = 0

    def prepare(self, calls: tuple[DenseCall, ...], upload: Upload | None = None) -> Fa3DenseStep | None:
        """The step's calls planned on the next wrapper slot (None: no calls). upload: how the
        rows they read travel (the runner's PinnedStaging.upload); None: a one-off pinned copy."""
        if not calls:
            return None
        batches, rows = ragged_batches(calls)
        slot = self._next
        self._next = (slot + 1) % NUM_SLOTS
        if self._planned[slot] is not None:
            self._planned[slot].synchronize()  # its pinned plan buffer was copied
        wrappers = []
        for batch in batches:
            wrapper = self._slots[slot][int(batch.causal)]
            wrapper.plan(_indptr(batch.qo_lens), _indptr(batch.kv_lens), self.num_heads, self.num_kv_heads,
                         self.head_dim, causal=batch.causal, sm_scale=1.0, q_data_type=FP8, kv_data_type=FP8,
                         o_data_type=self.out_dtype)
            wrappers.append(wrapper)
        event = torch.cuda.Event()
        event.record()
        self._planned[slot] = event
        rows_on_device = upload({"rows": rows})["rows"] if upload is not None else to_device(rows, self.device)
        return Fa3DenseStep(batches, wrappers, rows_on_device)

    def build(self) -> None:
        """Build (or load from FlashInfer's cache) the kernel for these heads now, by one call of
        each mask on 16 rows, rather than in the first step with prompts."""
        cache = torch.zeros(1, 16, self.num_kv_heads, self.head_dim, dtype=FP8, device=self.device)
        query = torch.zeros(16, self.num_heads, self.head_dim, dtype=self.out_dtype, device=self.device)
        blocks = torch.zeros(1, dtype=torch.int32, device=self.device)
        calls = (DenseCall(0, 16, blocks, 0, 16, -1, causal=False), DenseCall(0, 16, blocks, 0, 16, -1, causal=True))
        step = self.prepare(calls)
        out = torch.empty_like(query)
        step(query, cache, cache, out, out.float(), out[:, :, 0].float(), self.head_dim ** -0.5)
        torch.cuda.synchronize(self.device)
