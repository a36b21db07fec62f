"""Engine variants of one bench run (--quantization / --kv-cache-dtype lists): rows tagged with their
engine, FP8 rows bounded at the FP8 peak. FP8 itself needs a GPU: here a stand-in load
gives the CPU engine a variant's settings, so the tagging, bounds and merging are what is tested."""

import dataclasses

import pytest

from batchllm.perf.engine_variants import EngineVariant, parse_variants
from batchllm.perf.flop_bound import H200_BF16_PEAK_FLOPS, H200_FP8_PEAK_FLOPS
from batchllm.perf.markdown import render_markdown
from batchllm.perf.runner import BenchOptions, load_llm, run_variants

MODEL = "random:tiny?vocab_size=32000"
BF16, FP8, FP8_KV = EngineVariant(), EngineVariant("fp8"), EngineVariant("fp8", "fp8")


def test_parse_variants():
    assert parse_variants() == (BF16,)
    assert parse_variants("fp8") == (FP8,)
    assert parse_variants(" none , fp8,none ", "auto") == (BF16, FP8)  # spaces and repeats dropped
    assert parse_variants("none,fp8", "auto,fp8") == (BF16, EngineVariant(None, "fp8"), FP8, FP8_KV)
    assert [v.uses_fp8 for v in parse_variants("none,fp8", "auto,fp8")] == [False, True, True, True]
    assert FP8_KV.label == "quantization fp8, KV cache fp8" and BF16.label == "quantization none, KV cache auto"
    with pytest.raises(ValueError, match="unknown value 'FP8' in --quantization"):
        parse_variants("none,FP8")
    with pytest.raises(ValueError, match="--kv-cache-dtype is empty"):
        parse_variants("none", " ")


def _stand_in_load(failing: EngineVariant | None = None):
    """Loads the CPU engine (no quantization) and gives it the variant's settings, as an engine
    built with them would report; `failing` cannot load."""

    def load(options, variant):
        if variant == failing:
            raise ValueError("no FP8 on this device")
        llm = load_llm(options)
        engine = llm.engine
        cache = dataclasses.replace(engine.config.cache, kv_cache_dtype=variant.kv_cache_dtype)
        engine.config = dataclasses.replace(engine.config, quantization=variant.quantization, cache=cache)
        return llm

    return load


def _options(variants) -> BenchOptions:
    return BenchOptions(model=MODEL, workloads=["micro:32:8:2#4"], output_tokens=2, policies="batchllm,vllm",
                        kv_cache_tokens=4096, device="cpu", variants=tuple(variants), git_commit="abc")


def test_variants_run_in_one_invocation_with_tagged_rows():
    result = run_variants(_options([BF16, FP8_KV]), load=_stand_in_load(), log=lambda text: None)
    rows = result["rows"]
    assert [(r["policy"], r["quantization"], r["kv_cache_dtype"], r["tensor_parallel_size"]) for r in rows] == [
        ("batchllm", None, "auto", 1), ("vllm", None, "auto", 1),
        ("batchllm", "fp8", "fp8", 1), ("vllm", "fp8", "fp8", 1)]
    bf16_row, fp8_row = rows[0], rows[2]
    # the same work, bounded at each engine's peak
    assert fp8_row["flop_bound_s"] == pytest.approx(bf16_row["flop_bound_s"] * H200_BF16_PEAK_FLOPS
                                                    / H200_FP8_PEAK_FLOPS, abs=1e-3)
    assert fp8_row["flop_bound_peak_tflop_per_s"] == H200_FP8_PEAK_FLOPS / 1e12
    assert bf16_row["flop_bound_peak_tflop_per_s"] == H200_BF16_PEAK_FLOPS / 1e12
    # float32 KV (CPU) against one byte an element: the rows carry their own, the header none
    assert bf16_row["kv_bytes_per_token"] == 4 * fp8_row["kv_bytes_per_token"]
    assert "kv_bytes_per_token" not in result and "load_errors" not in result
    table = render_markdown(result)
    assert "| quantization / KV cache |" in table
    assert "| micro:32:8:2 | vllm | fp8 / fp8 |" in table and "| micro:32:8:2 | batchllm | none / auto |" in table
    assert f"rows with quantization fp8 at {H200_FP8_PEAK_FLOPS / 1e12:.0f} TFLOP/s" in table
    assert "the row's KV bytes per token" in table


def test_a_variant_that_cannot_load_leaves_the_others():
    result = run_variants(_options([FP8, BF16]), load=_stand_in_load(failing=FP8), log=lambda text: None)
    assert [row["quantization"] for row in result["rows"]] == [None, None]
    assert result["kv_bytes_per_token"] == result["rows"][0]["kv_bytes_per_token"]
    assert result["load_errors"] == [{"quantization": "fp8", "kv_cache_dtype": "auto", "error":
                                      f"cannot load the model {MODEL} (quantization fp8, KV cache auto): "
                                      "no FP8 on this device"}]
    assert "- not run: cannot load the model" in render_markdown(result)
    nothing = run_variants(_options([FP8]), load=_stand_in_load(failing=FP8), log=lambda text: None)
    assert nothing["rows"] == [] and len(nothing["load_errors"]) == 1


def test_graph_replays_count_the_timed_run_only():
    """A row's graph_replays (and its other step counts) are those of its timed run, not the
    warm-up's or earlier rows'. On CPU no graphs run, so a counter stands in for the runner's
    graph counts: each run adds 7 replays."""
    options = BenchOptions(model=MODEL, workloads=["micro:32:8:2#4"], output_tokens=2,
                           policies="batchllm,vllm", kv_cache_tokens=4096, device="cpu", git_commit="abc")
    llm = load_llm(options)
    counts = {"graph_replays": 0}
    real_generate = llm.generate

    def generate(*args, **kwargs):
        try:
            return real_generate(*args, **kwargs)
        finally:
            counts["graph_replays"] += 7

    llm.generate = generate
    eager_counts = llm.engine.runner.graph_counts
    llm.engine.runner.graph_counts = lambda: {**eager_counts(), **counts}
    result = run_variants(options, load=lambda *_: llm, log=lambda text: None)
    assert [(row["policy"], row["graph_replays"]) for row in result["rows"]] == [("batchllm", 7), ("vllm", 7)]
    # every step ran eagerly on the CPU, and the row says so
    assert [row["eager_steps"] == row["steps"] > 0 for row in result["rows"]] == [True, True]
    assert [row["piecewise_steps"] for row in result["rows"]] == [0, 0]


def test_every_workload_gets_its_warm_pass_before_its_timed_rows():
    """Decode graphs are captured per block-table width, which follows the prompt lengths: a later
    workload's first policy must not pay the captures of its shapes."""
    options = BenchOptions(model=MODEL, workloads=["micro:32:8:2#4", "micro:96:8:2#4"], output_tokens=2,
                           policies="batchllm,vllm", kv_cache_tokens=4096, device="cpu", git_commit="abc")
    llm = load_llm(options)
    events = []
    real_generate = llm.generate

    def generate(prompts, *args, **kwargs):
        events.append(("run", len(prompts[0])))
        return real_generate(prompts, *args, **kwargs)

    llm.generate = generate

    def log(text):
        if text.startswith("warm pass"):
            events.append(("warm pass log",))
        elif text.startswith("{"):
            events.append(("row",))

    run_variants(options, load=lambda *_: llm, log=log)
    kinds = [event[0] for event in events]
    # per workload: the warm pass (a run, then its log line), then per policy a warm-up batch,
    # the timed run and the row
    assert kinds == ["run", "warm pass log", "run", "run", "row", "run", "run", "row"] * 2
    prompt_lengths = [event[1] for event in events if event[0] == "run"]
    assert len(set(prompt_lengths[:5])) == 1 and len(set(prompt_lengths[5:])) == 1
    assert prompt_lengths[0] != prompt_lengths[5]  # the second warm pass ran the second workload
