"""The HF transformers `generate` peer, timed at its best: static batches of equal-length prompts
(hf_batches.py), sdpa attention, its own random weights (speed does not depend on them), each
batch size of a sweep warmed up on its own batch shapes, the best one reported. It runs after
every engine row, with the engines freed (runner.run_variants): the engine's KV cache would
otherwise hold most of the GPU memory."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from batchllm.perf.flop_bound import H200_BF16_PEAK_FLOPS
from batchllm.perf.hf_batches import PeerBatch, plan_peer_batches, static_batch_steps
from batchllm.perf.roofline import Roofline, TrafficModel, roofline

GIB = 1 << 30
# Batch sizes that the sweep adds between the largest one that fit and one that ran out of memory
# are multiples of this.
REFINE_MULTIPLE = 16


@dataclass(frozen=True)
class PeerJob:
    """What the peer needs from the bench once the engines are gone."""

    workload_label: str
    model: str
    arch: object  # ModelArchConfig
    device: object  # torch.device
    dtype: object  # torch.dtype of the engine's (unquantized) weights
    prompts: list[list[int]]
    max_tokens: list[int]
    bound_seconds: float  # the workload's FLOP bound at the bf16 peak (HF runs no FP8)


@dataclass(frozen=True)
class _Measurement:
    batch_size: int
    batches: list[PeerBatch]
    seconds: float

    @property
    def num_requests(self) -> int:
        return sum(batch.num_rows for batch in self.batches)

    @property
    def req_per_s(self) -> float:
        return self.num_requests / self.seconds


def _hf_model(job: PeerJob):
    """LlamaForCausalLM of the job's shape with sdpa attention and no EOS token: every row runs to
    max_new_tokens without a logits processor forcing it (min_new_tokens would add one)."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    arch = job.arch
    config = LlamaConfig(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
                         intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_layers,
                         num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
                         head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta,
                         max_position_embeddings=arch.max_position_embeddings,
                         tie_word_embeddings=arch.tie_word_embeddings,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    dtype_keyword = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"  # renamed in 5
    with job.device:
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", **{dtype_keyword: job.dtype})
    return model.eval()


def _inputs(job: PeerJob, batch: PeerBatch) -> dict:
    """generate's keyword arguments for one batch; left padding and a mask only where lengths differ."""
    import torch

    rows = [job.prompts[index] for index in batch.request_indices]
    kwargs = {"max_new_tokens": batch.max_new_tokens, "do_sample": False}
    if not batch.padded:
        kwargs["input_ids"] = torch.tensor(rows, device=job.device)
        return kwargs
    pads = [batch.width - len(row) for row in rows]
    kwargs["input_ids"] = torch.tensor([[0] * pad + row for pad, row in zip(pads, rows)], device=job.device)
    kwargs["attention_mask"] = torch.tensor([[0] * pad + [1] * len(row) for pad, row in zip(pads, rows)],
                                            device=job.device)
    kwargs["pad_token_id"] = 0
    return kwargs


def _generate(model, batch: PeerBatch, kwargs: dict) -> None:
    output = model.generate(**kwargs)
    if tuple(output.shape) != (batch.num_rows, batch.width + batch.max_new_tokens):
        raise RuntimeError(f"HF generate returned shape {tuple(output.shape)} for a batch of {batch.num_rows} x "
                           f"{batch.width} tokens and {batch.max_new_tokens} new tokens")


def _measure(model, job: PeerJob, batch_size: int, num_requests: int) -> _Measurement:
    """Warm up on each distinct batch shape (the timed inputs themselves), then time every batch
    covering the first num_requests requests back to back."""
    import torch

    batches = plan_peer_batches([len(p) for p in job.prompts], job.max_tokens, batch_size, num_requests)
    inputs = [_inputs(job, batch) for batch in batches]
    synchronize = torch.cuda.synchronize if job.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        warmed: set = set()
        for batch, kwargs in zip(batches, inputs):
            if batch.shape not in warmed:
                warmed.add(batch.shape)
                _generate(model, batch, kwargs)
        synchronize()
        started = time.perf_counter()
        for batch, kwargs in zip(batches, inputs):
            _generate(model, batch, kwargs)
        synchronize()
        seconds = time.perf_counter() - started
    return _Measurement(batch_size, batches, seconds)


def _roofline(job: PeerJob, batches: list[PeerBatch]) -> Roofline:
    """The roofline of the steps HF runs for these batches (its own schedule: no prefix sharing,
    padding computed), weights and KV in the job's dtype."""
    from batchllm.engine.kv_cache import kv_bytes_per_token

    arch, itemsize = job.arch, job.dtype.itemsize
    traffic = TrafficModel(itemsize, itemsize,
                           kv_bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, job.dtype))
    steps = [step for batch in batches for step in static_batch_steps(batch)]
    return roofline(arch, steps, traffic, H200_BF16_PEAK_FLOPS)


def _sweep_entry(measurement: _Measurement, roofline_s: float) -> dict:
    return {"batch_size": measurement.batch_size, "batches": len(measurement.batches),
            "requests": measurement.num_requests, "seconds": round(measurement.seconds, 3),
            "req_per_s": round(measurement.req_per_s, 2), "roofline_s": float(f"{roofline_s:.4g}")}


def _try_measure(model, job: PeerJob, batch_size: int, num_requests: int,
                 log: Callable[[str], None]) -> tuple[_Measurement | None, dict]:
    """(the measurement, its sweep entry), or (None, an entry with the error) when it fails."""
    try:
        measurement = _measure(model, job, batch_size, num_requests)
    except Exception as error:  # noqa: BLE001 -- out of memory at one size: the others still count
        log(f"hf-generate batch {batch_size}: failed: {error!r}")
        return None, {"batch_size": batch_size, "error": repr(error)}
    log(f"hf-generate batch {batch_size}: {measurement.num_requests} requests in {measurement.seconds:.2f} s, "
        f"{measurement.req_per_s:.2f} req/s")
    return measurement, _sweep_entry(measurement, _roofline(job, measurement.batches).seconds)


def next_refinement(sweep: list[dict], best_batch_size: int | None, multiple: int = REFINE_MULTIPLE) -> int | None:
    """The batch size the sweep tries next, or None: when the fastest size so far is the largest
    that fit and a larger one ran out of memory, the midpoint of the two rounded down to a
    multiple of `multiple` (throughput was still rising at the memory limit, so the best size lies
    between them); None once no untried size is left there."""
    fitted = [entry["batch_size"] for entry in sweep if "error" not in entry]
    if best_batch_size is None or best_batch_size != max(fitted, default=None):
        return None
    out_of_memory = [entry["batch_size"] for entry in sweep
                     if "out of memory" in entry.get("error", "").lower() and entry["batch_size"] > best_batch_size]
    if not out_of_memory:
        return None
    middle = (best_batch_size + min(out_of_memory)) // 2 // multiple * multiple
    tried = {entry["batch_size"] for entry in sweep}
    return middle if middle > best_batch_size and middle not in tried else None


def hf_peer_row(job: PeerJob, batch_sizes: tuple[int, ...], num_requests: int,
                log: Callable[[str], None] = print) -> dict:
    """Time HF generate at each batch size over whole batches covering the first num_requests
    requests; the row is the best batch size (highest requests/s), its time scaled to the
    workload, with every size's measurement under "sweep". A batch size that fails (out of
    memory) is kept in the sweep with its error; raises when every size fails. When the largest
    size that fit is the fastest and a larger one ran out of memory, the sizes between them are
    bisected (next_refinement; their entries are marked "refined")."""
    import torch

    from batchllm.perf.device_memory import free_device_memory

    cuda = job.device.type == "cuda"
    in_use_gib = torch.cuda.memory_allocated(job.device) / GIB if cuda else 0.0
    model = _hf_model(job)
    sweep: list[dict] = []
    best: _Measurement | None = None

    def run(batch_size: int, refined: bool) -> None:
        nonlocal best
        measurement, entry = _try_measure(model, job, batch_size, num_requests, log)
        free_device_memory()  # after the failure's traceback (and the tensors it holds) is gone
        sweep.append({**entry, "refined": True} if refined else entry)
        if measurement is not None and (best is None or measurement.req_per_s > best.req_per_s):
            best = measurement

    for batch_size in batch_sizes:
        run(batch_size, refined=False)
    while (batch_size := next_refinement(sweep, best.batch_size if best else None)) is not None:
        run(batch_size, refined=True)
    del model
    free_device_memory()
    if best is None:
        raise RuntimeError(f"HF generate failed at every batch size: {sweep}")
    num_prompts = len(job.prompts)
    scale = num_prompts / best.num_requests
    seconds = best.seconds * scale
    bound = _roofline(job, best.batches)
    roofline_s, serial_roofline_s = bound.seconds * scale, bound.serial_seconds * scale
    return {"workload": job.workload_label, "requests": num_prompts, "model": job.model,
            "policy": f"hf-generate (static batch {best.batch_size}, sdpa; scaled)",
            "quantization": None, "kv_cache_dtype": "auto", "tensor_parallel_size": 1,
            "seconds": round(seconds, 3), "req_per_s": round(num_prompts / seconds, 2),
            "output_tok_per_s": round(sum(job.max_tokens) / seconds, 1),
            "measured_seconds": round(best.seconds, 3), "measured_requests": best.num_requests,
            "batch_size": best.batch_size,
            "flop_bound_s": round(job.bound_seconds, 3), "time_over_bound": round(seconds / job.bound_seconds, 2),
            "flop_bound_peak_tflop_per_s": round(H200_BF16_PEAK_FLOPS / 1e12, 1),
            "roofline_s": float(f"{roofline_s:.4g}"), "time_over_roofline": round(seconds / roofline_s, 2),
            "serial_roofline_s": float(f"{serial_roofline_s:.4g}"),
            "time_over_serial_roofline": round(seconds / serial_roofline_s, 2),
            "device_memory_in_use_gib_at_start": round(in_use_gib, 2), "sweep": sweep}
