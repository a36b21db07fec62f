"""The HF generate peer: how it batches a workload, its sweep over batch sizes (a tiny model on
CPU), and its place in a bench run: after every engine row, with the engines freed."""

import gc
import json
import weakref

import pytest
import torch

from batchllm.perf import hf_peer
from batchllm.perf.hf_batches import PeerBatch, parse_batch_sizes, plan_peer_batches, static_batch_steps
from batchllm.perf.hf_peer import PeerJob, hf_peer_row
from batchllm.perf.roofline import StepWork
from batchllm.perf.runner import BenchOptions, load_llm, run_variants
from batchllm.models.presets import parse_random_spec

MODEL = "random:tiny?vocab_size=32000"


def _indices(batches):
    return [batch.request_indices for batch in batches]


def test_equal_length_prompts_make_unpadded_batches_in_request_order():
    lengths, max_tokens = [56] * 10, [3] * 10
    # the first 5 requests at batch 2: three whole batches (6 requests)
    batches = plan_peer_batches(lengths, max_tokens, batch_size=2, num_requests=5)
    assert _indices(batches) == [(0, 1), (2, 3), (4, 5)]
    assert all(batch == PeerBatch(batch.request_indices, 56, 3, False) for batch in batches)
    assert _indices(plan_peer_batches(lengths, max_tokens, batch_size=4, num_requests=4)) == [(0, 1, 2, 3)]
    # a batch larger than the workload: one batch of all of it
    assert _indices(plan_peer_batches(lengths, max_tokens, batch_size=64, num_requests=64)) == [tuple(range(10))]
    with pytest.raises(ValueError, match="at least 1"):
        plan_peer_batches(lengths, max_tokens, batch_size=0, num_requests=4)


def test_mixed_lengths_batch_equal_lengths_together_and_pad_the_rest():
    lengths = [10, 20, 10, 30, 10, 20, 10, 25]
    max_tokens = [4, 4, 4, 4, 4, 6, 4, 4]
    batches = plan_peer_batches(lengths, max_tokens, batch_size=2, num_requests=len(lengths))
    # length 10: (0, 2), (4, 6); length 20: (1, 5); leftovers 30 and 25, sorted by length: (7, 3);
    # in the order of each batch's first request
    assert _indices(batches) == [(0, 2), (1, 5), (7, 3), (4, 6)]
    assert [(b.width, b.max_new_tokens, b.padded) for b in batches] == [(10, 4, False), (20, 6, False),
                                                                        (30, 4, True), (10, 4, False)]
    # only the batches holding one of the first 2 requests
    assert _indices(plan_peer_batches(lengths, max_tokens, 2, num_requests=2)) == [(0, 2), (1, 5)]


def test_static_batch_steps():
    batch = PeerBatch((0, 1, 2), width=5, max_new_tokens=3, padded=False)
    assert static_batch_steps(batch) == [
        StepWork(15, 3 * 15, 3, 15),  # prefill: 3 rows x 5 positions, each row attends 1..5 keys
        StepWork(3, 3 * 6, 3, 3 * 6),  # the first new token fed back at position 5
        StepWork(3, 3 * 7, 3, 3 * 7),
    ]
    assert batch.shape == (3, 5, 3, False)


def test_parse_batch_sizes():
    assert parse_batch_sizes("64") == (64,)
    assert parse_batch_sizes(" 64, 128,64 ") == (64, 128)
    assert parse_batch_sizes("0") == ()
    for bad in ("64,x", "0,64", "-1", ","):
        with pytest.raises(ValueError, match="--hf-peer"):
            parse_batch_sizes(bad)


def _job(num_requests=6, prompt_len=12, output_tokens=3) -> PeerJob:
    arch = parse_random_spec(MODEL).config
    prompts = [[1000 + 7 * i + j for j in range(prompt_len)] for i in range(num_requests)]
    return PeerJob("micro:test", MODEL, arch, torch.device("cpu"), torch.float32, prompts,
                   [output_tokens] * num_requests, bound_seconds=1e-6)


def test_hf_model_has_no_eos_to_stop_on():
    import dataclasses

    model = hf_peer._hf_model(dataclasses.replace(_job(), dtype=torch.bfloat16))
    assert model.generation_config.eos_token_id is None
    assert model.config._attn_implementation == "sdpa"
    assert next(model.parameters()).dtype == torch.bfloat16


def test_sweep_reports_the_fastest_batch_size(monkeypatch):
    job = _job()
    timings = {2: 0.6, 4: 0.2}  # seconds per batch

    def fake_measure(model, job, batch_size, num_requests):
        batches = plan_peer_batches([len(p) for p in job.prompts], job.max_tokens, batch_size, num_requests)
        return hf_peer._Measurement(batch_size, batches, timings[batch_size] * len(batches))

    monkeypatch.setattr(hf_peer, "_measure", fake_measure)
    row = hf_peer_row(job, (2, 4), num_requests=4, log=lambda text: None)
    assert row["policy"] == "hf-generate (static batch 4, sdpa; scaled)" and row["batch_size"] == 4
    assert [(e["batch_size"], e["batches"], e["requests"], e["seconds"]) for e in row["sweep"]] == [
        (2, 2, 4, 1.2), (4, 1, 4, 0.2)]
    assert row["measured_seconds"] == 0.2 and row["measured_requests"] == 4
    assert row["seconds"] == pytest.approx(0.2 * 6 / 4, abs=1e-3) and row["req_per_s"] == pytest.approx(20.0)
    assert row["roofline_s"] > 0 and row["time_over_roofline"] > 0 and row["time_over_bound"] > 0
    assert row["serial_roofline_s"] >= row["roofline_s"] and 0 < row["time_over_serial_roofline"] <= row["time_over_roofline"]


def test_a_failing_batch_size_stays_in_the_sweep(monkeypatch):
    job = _job()
    real_measure = hf_peer._measure

    def measure(model, job, batch_size, num_requests):
        if batch_size == 4:
            raise RuntimeError("CUDA out of memory (stand-in)")
        return real_measure(model, job, batch_size, num_requests)

    monkeypatch.setattr(hf_peer, "_measure", measure)
    row = hf_peer_row(job, (4, 2), num_requests=4, log=lambda text: None)
    assert row["batch_size"] == 2
    assert row["sweep"][0] == {"batch_size": 4, "error": "RuntimeError('CUDA out of memory (stand-in)')"}
    monkeypatch.setattr(hf_peer, "_measure", lambda *args: (_ for _ in ()).throw(RuntimeError("oom")))
    with pytest.raises(RuntimeError, match="every batch size"):
        hf_peer_row(job, (2,), num_requests=4, log=lambda text: None)


def test_sweep_bisects_up_to_the_memory_limit_while_throughput_rises(monkeypatch):
    """128 fits and beats 64, 256 runs out of memory: the sweep tries 192 (fits, faster), 224
    (out of memory), 208 (fits, fastest) and stops (the midpoint of 208 and 224 rounds down to 208)."""
    job = _job()
    tried = []

    def fake_measure(model, job, batch_size, num_requests):
        tried.append(batch_size)
        if batch_size > 210:
            raise RuntimeError("CUDA out of memory. Tried to allocate 15.04 GiB (stand-in)")
        batches = plan_peer_batches([len(p) for p in job.prompts], job.max_tokens, 2, 4)
        return hf_peer._Measurement(batch_size, batches, 1.0 / batch_size)  # faster with every size

    monkeypatch.setattr(hf_peer, "_measure", fake_measure)
    row = hf_peer_row(job, (64, 128, 256), num_requests=4, log=lambda text: None)
    assert tried == [64, 128, 256, 192, 224, 208]
    assert row["batch_size"] == 208
    assert [e.get("refined", False) for e in row["sweep"]] == [False, False, False, True, True, True]
    from batchllm.perf.markdown import sweep_note

    note = sweep_note(row)
    assert "batch 128: " in note and "batch 224 (bisected): failed" in note
    assert "batch 208 (bisected): 832.00 req/s over 4 requests (reported)" in note


def test_next_refinement_only_while_the_largest_fitting_size_is_the_fastest():
    from batchllm.perf.hf_peer import next_refinement

    oom = {"batch_size": 256, "error": "OutOfMemoryError('CUDA out of memory.')"}
    fits = [{"batch_size": 64, "req_per_s": 9.4}, {"batch_size": 128, "req_per_s": 10.7}]
    assert next_refinement([*fits, oom], 128) == 192
    assert next_refinement([*fits, oom], 64) is None  # 128 fit and was slower: larger sizes do not pay
    assert next_refinement(fits, 128) is None  # nothing ran out of memory
    other = {"batch_size": 256, "error": "RuntimeError('shape mismatch')"}
    assert next_refinement([*fits, other], 128) is None  # only memory bounds the search
    assert next_refinement([{"batch_size": 128}, {"batch_size": 136, "error": "out of memory"}], 128) is None
    assert next_refinement([*fits, oom], None) is None


def test_generate_runs_every_batch_to_its_length():
    """The real generate on CPU: whole batches, full length (the shape is checked per call)."""
    job = _job(num_requests=5, output_tokens=4)
    row = hf_peer_row(job, (2, 8), num_requests=3, log=lambda text: None)
    assert {entry["batch_size"]: entry["requests"] for entry in row["sweep"]} == {2: 4, 8: 5}
    assert all(entry["seconds"] > 0 for entry in row["sweep"])
    mixed = PeerJob(job.workload_label, MODEL, job.arch, job.device, job.dtype,
                    [[1000] * 12, [1001] * 9, [1002] * 12], [4, 2, 4], 1e-6)  # one padded batch
    assert hf_peer_row(mixed, (4,), num_requests=3, log=lambda text: None)["measured_requests"] == 3


def test_peer_runs_after_every_engine_row_with_the_engines_freed(monkeypatch):
    engines = []

    def load(options, variant):
        llm = load_llm(options, variant)
        engines.append(weakref.ref(llm.engine))
        return llm

    def peer_row(job, batch_sizes, num_requests, log):
        gc.collect()
        assert all(ref() is None for ref in engines), "an engine is still alive when the peer runs"
        assert batch_sizes == (2, 4) and num_requests == 4 and len(job.prompts) == 4
        return {"workload": job.workload_label, "policy": "hf-generate (stand-in)", "seconds": 1.0}

    monkeypatch.setattr(hf_peer, "hf_peer_row", peer_row)
    options = BenchOptions(model=MODEL, workloads=["micro:32:8:2#4"], output_tokens=2, policies="batchllm,vllm",
                           kv_cache_tokens=4096, device="cpu", git_commit="abc", hf_peer=(2, 4))
    updates = []
    result = run_variants(options, load=load, log=lambda text: None, on_update=updates.append)
    assert [row["policy"] for row in result["rows"]] == ["batchllm", "vllm", "hf-generate (stand-in)"]
    assert [len(update["rows"]) for update in updates] == [1, 2, 3]
    assert updates[-1] == result and len(engines) == 1


def test_a_failing_peer_keeps_the_engine_rows(monkeypatch):
    def peer_row(job, batch_sizes, num_requests, log):
        raise RuntimeError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(hf_peer, "hf_peer_row", peer_row)
    options = BenchOptions(model=MODEL, workloads=["micro:32:8:2#4"], output_tokens=2, policies="batchllm",
                           kv_cache_tokens=4096, device="cpu", git_commit="abc", hf_peer=(8,), hf_peer_requests=2)
    result = run_variants(options, log=lambda text: None)
    assert [row.get("error") for row in result["rows"]] == [None, "RuntimeError('CUDA out of memory (stand-in)')"]
    assert json.dumps(result)
