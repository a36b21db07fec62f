"""The FP8 accuracy gate's parts that need no GPU: its text and token cut, the token files, the
metric math on hand-made logits, the prefill steps, and the runner path on a tiny random model."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from batchllm.perf import logit_metrics
from batchllm.perf.eval_text import build_text, cut_tokens, read_tokens_file, text_files, write_tokens_file
from batchllm.perf.fp8_accuracy import (AccuracyOptions, Variant, gate_failures, measure_fp8_accuracy,
                                         prefill_steps, sequence_logits)
from batchllm.models.fp8_linear import fp8_unsupported_reason
from batchllm.perf.logit_metrics import compare_next_token, perplexity
from script_loader import load_benchmark_script

LN3 = math.log(3.0)


def test_text_is_readme_then_docs_in_name_order(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("readme\n")
    (tmp_path / "docs" / "zeta.md").write_text("zeta\n\n")
    (tmp_path / "docs" / "alpha.md").write_text("alpha")
    (tmp_path / "docs" / "notes.txt").write_text("not markdown")
    assert [p.name for p in text_files(tmp_path)] == ["README.md", "alpha.md", "zeta.md"]
    assert build_text(tmp_path) == "readme\n\nalpha\n\nzeta"


def test_text_needs_a_readme(tmp_path):
    with pytest.raises(FileNotFoundError, match="README.md"):
        build_text(tmp_path)


def test_repository_text_is_long_enough():
    # about 4 characters a token: the default 2048 tokens need well over 8 kB of text
    assert len(build_text(Path(__file__).resolve().parents[1])) > 4 * 4096


def test_cut_tokens():
    assert cut_tokens([5, 6, 7, 8], 3) == [5, 6, 7]
    assert cut_tokens((5, 6), 2) == [5, 6]
    with pytest.raises(ValueError, match="fewer than the 5"):
        cut_tokens([1, 2, 3], 5)
    with pytest.raises(ValueError, match="at least 2"):
        cut_tokens([1, 2, 3], 1)


def test_tokens_file_round_trip(tmp_path):
    path = tmp_path / "sub" / "ids.json"
    write_tokens_file(path, [3, 1, 4])
    assert json.loads(path.read_text()) == [3, 1, 4]
    assert read_tokens_file(path) == [3, 1, 4]
    for bad in ('{"ids": [1]}', "[1, -2]", "[1, 2.5]", "[true]"):
        path.write_text(bad)
        with pytest.raises(ValueError, match="JSON list"):
            read_tokens_file(path)


# Vocabulary of 2, tokens [0, 1, 0]: row 0 predicts token 1, row 1 predicts token 0, row 2 has no
# next token (its values must not count). Reference: p = [1/4, 3/4] then [3/4, 1/4]; candidate:
# [3/4, 1/4] twice (float64: the expected values are exact to rounding).
TOKENS = [0, 1, 0]
REFERENCE = torch.tensor([[0.0, LN3], [LN3, 0.0], [100.0, -100.0]], dtype=torch.float64)
CANDIDATE = torch.tensor([[LN3, 0.0], [LN3, 0.0], [-100.0, 100.0]], dtype=torch.float64)


def test_perplexity_of_hand_made_logits():
    # both targets at probability 3/4: perplexity 4/3
    assert perplexity(REFERENCE, TOKENS) == pytest.approx(4 / 3, rel=1e-12)
    # targets at 1/4 and 3/4: exp(-(ln 1/4 + ln 3/4) / 2) = 4 / sqrt(3)
    assert perplexity(CANDIDATE, TOKENS) == pytest.approx(4 / math.sqrt(3), rel=1e-12)


@pytest.mark.parametrize("rows_per_block", [1, 2, 256])
def test_comparison_of_hand_made_logits(monkeypatch, rows_per_block):
    monkeypatch.setattr(logit_metrics, "ROWS_PER_BLOCK", rows_per_block)
    metrics = compare_next_token(REFERENCE, CANDIDATE, TOKENS)
    assert metrics.reference_perplexity == pytest.approx(4 / 3, rel=1e-12)
    assert metrics.perplexity_ratio == pytest.approx(math.sqrt(3), rel=1e-12)
    # row 0: 1/4 ln(1/3) + 3/4 ln 3 = ln(3) / 2; row 1: 0 -> mean ln(3) / 4
    assert metrics.kl == pytest.approx(LN3 / 4, rel=1e-12)
    assert metrics.top1_agreement == 0.5  # row 0 disagrees, row 1 agrees (row 2 is not counted)


def test_identical_logits_and_zero_probabilities():
    same = compare_next_token(CANDIDATE, CANDIDATE.clone(), TOKENS)
    assert (same.perplexity_ratio, same.kl, same.top1_agreement) == (1.0, 0.0, 1.0)
    # a token the reference gives probability 0 adds nothing to KL: KL([1, 0] || [1/2, 1/2]) = ln 2
    reference = torch.tensor([[0.0, -math.inf], [0.0, 0.0]])
    assert compare_next_token(reference, torch.zeros(2, 2), [1, 0]).kl == pytest.approx(math.log(2), rel=1e-12)


def test_comparison_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shapes differ"):
        compare_next_token(REFERENCE, CANDIDATE[:2], TOKENS)
    with pytest.raises(ValueError, match="token ids"):
        perplexity(REFERENCE, [0, 1])


def test_prefill_steps_append_blocks_in_order():
    from batchllm.engine.batch_rows import BatchRows
    from batchllm.engine.step_inputs import build_step_inputs

    steps = prefill_steps(list(range(100, 140)), chunk_tokens=16, block_size=8)
    chunks = [step.chunks[0] for step in steps]
    assert [step.step_index for step in steps] == [0, 1, 2]
    assert [(c.start_position, c.num_tokens) for c in chunks] == [(0, 16), (16, 16), (32, 8)]
    assert [(c.block_ids_start, c.new_block_ids) for c in chunks] == [(0, (0, 1)), (2, (2, 3)), (4, (4,))]
    assert chunks[1].token_ids == tuple(range(116, 132))
    assert not any(c.sample or c.is_prefix or c.is_decode for c in chunks)
    rows = BatchRows()
    # blocks 0, 1, 2, ... in order: every position's KV slot is the position itself
    slots = [build_step_inputs(step, 8, rows.step_rows(step)).slot_mapping.tolist() for step in steps]
    assert sum(slots, []) == list(range(40))


TINY = AccuracyOptions(model="random:tiny", dtype="float32", device="cpu", chunk_tokens=48)


def test_runner_logits_do_not_depend_on_the_chunk():
    """Chunks of 48 and of 1 token read the earlier tokens back from the paged KV cache; one chunk
    of all 150 reads nothing back: the logits agree."""
    from batchllm.perf.fp8_accuracy import REFERENCE_VARIANT, engine_config
    from batchllm.engine.loading import load_parts

    token_ids = torch.randint(3, 500, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    parts = load_parts(engine_config(TINY, REFERENCE_VARIANT, len(token_ids)))
    assert parts.kv_cache.num_blocks * parts.runner.block_size == 160  # whole blocks, just enough
    whole = sequence_logits(parts, token_ids, chunk_tokens=len(token_ids))
    assert whole.shape == (150, parts.arch.vocab_size) and whole.dtype == torch.float32
    for chunk_tokens in (48, 1):
        torch.testing.assert_close(sequence_logits(parts, token_ids, chunk_tokens), whole, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="do not fit the KV cache"):
        sequence_logits(parts, token_ids + token_ids, 48)


def test_measurement_of_a_variant_against_itself():
    token_ids = torch.randint(3, 500, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    lines = []
    result = measure_fp8_accuracy(token_ids, TINY, variants=[Variant("same"), Variant("again")], log=lines.append)
    assert set(result) == {"model", "tokens", "bf16_perplexity", "same", "again"}
    assert result["model"] == "random:tiny" and result["tokens"] == 100
    for name in ("same", "again"):
        assert set(result[name]) == {"perplexity_ratio", "kl", "top1_agreement", "perplexity"}
        assert result[name]["perplexity_ratio"] == pytest.approx(1.0, abs=1e-9)
        assert result[name]["kl"] == pytest.approx(0.0, abs=1e-9)
        assert result[name]["top1_agreement"] == 1.0
    assert len(lines) == 3 and lines[1].startswith("same") and "top-1 agreement 100.00%" in lines[1]


def test_gate():
    passing = {"perplexity_ratio": 1.01, "kl": 0.01, "top1_agreement": 0.95}
    assert gate_failures({"weights_activations": passing, "weights_activations_kv": passing}) == []
    failures = gate_failures({"weights_activations": {**passing, "perplexity_ratio": 1.06},
                              "weights_activations_kv": {**passing, "perplexity_ratio": 1.06, "top1_agreement": 0.7}})
    assert failures == ["weights_activations: perplexity ratio 1.0600 > 1.05",
                        "weights_activations_kv: top-1 agreement 0.7000 < 0.8"]
    assert gate_failures({"weights_activations": passing,
                          "weights_activations_kv": {**passing, "perplexity_ratio": 1.07}}) == []


def test_fp8_needs_a_recent_gpu():
    assert "compute capability 8.9" in fp8_unsupported_reason("cpu")


def _script():
    return load_benchmark_script("fp8_accuracy.py")


def test_script_reads_a_tokens_file_and_refuses_a_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    script = _script()
    tokens, out = tmp_path / "ids.json", tmp_path / "r.json"
    write_tokens_file(tokens, list(range(10)))
    assert script.main(["--tokens-file", str(tokens), "--num-tokens", "20", "--out", str(out)]) == 2
    assert "10 tokens, fewer than the 20" in capsys.readouterr().err
    assert script.main(["--tokens-file", str(tokens), "--num-tokens", "8", "--out", str(out)]) == 2
    assert "compute capability 8.9" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(SystemExit):
        script.main(["--tokens-file", str(tokens), "--write-tokens-file", str(out)])


def test_xqa_runs_the_fp8_kv_variant_and_fused_the_others():
    from batchllm.perf.fp8_accuracy import FP8_VARIANTS, REFERENCE_VARIANT, engine_config, variant_attention_backend

    options = dataclasses.replace(TINY, attention_backend="xqa")
    backends = {variant.name: engine_config(options, variant, 100).attention_backend
                for variant in (REFERENCE_VARIANT, *FP8_VARIANTS)}
    assert backends == {"reference": "fused", "weights_activations": "fused", "weights_activations_kv": "xqa"}
    for name in ("auto", "torch", "fused"):
        assert {variant_attention_backend(name, variant) for variant in (REFERENCE_VARIANT, *FP8_VARIANTS)} == {name}


def test_fa3_min_rows_gives_an_fa3_backend_dense_calls_and_needs_xqa(tmp_path, capsys):
    """fa3_min_rows: the FP8-KV variant's chunks attend wholly by FA3 from that many rows (its
    causal calls hold their context); it takes xqa, and a backend without FA3 is an error."""
    from batchllm.attention_plan.tile_config import default_tile_config
    from batchllm.perf.fp8_accuracy import use_fa3_from

    class Backend:
        fa3_dense = object()
        prefill_tile = dataclasses.replace(default_tile_config(64, 3, interpret=False), dense_any_size=True,
                                           dense_causal_whole=True)

    backend = Backend()
    assert backend.prefill_tile.dense_min_rows == 0  # heads of 64: no dense calls by default
    use_fa3_from(backend, 512)
    assert backend.prefill_tile == dataclasses.replace(Backend.prefill_tile, dense_min_rows=512,
                                                       dense_causal_min_rows=512)
    assert backend.prefill_tile.causal_square_rows() == 512
    backend.fa3_dense = None
    with pytest.raises(RuntimeError, match="runs no FA3"):
        use_fa3_from(backend, 512)
    with pytest.raises(ValueError, match="xqa"):
        dataclasses.replace(TINY, fa3_min_rows=512)
    with pytest.raises(ValueError, match="positive"):
        dataclasses.replace(TINY, attention_backend="xqa", fa3_min_rows=0)
    tokens = tmp_path / "ids.json"
    write_tokens_file(tokens, list(range(10)))
    assert _script().main(["--tokens-file", str(tokens), "--num-tokens", "8", "--fa3-min-rows", "512"]) == 2
    assert "xqa" in capsys.readouterr().err
