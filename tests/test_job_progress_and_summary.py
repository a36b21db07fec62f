"""What a run reports: a progress bar with one rate (requests answered per second of generation)
and a summary that keeps model loading apart from generation and counts the prefill tokens that
prefix sharing saved (random:tiny, token-id prompts)."""

import json

import pytest

import batchllm.job.progress as progress_module
from batchllm.cli.main import main
from batchllm.job.batch_job import BatchJobSummary
from batchllm.job.progress import Progress

SHARED_PREFIX = list(range(10, 42))  # 32 tokens: two KV blocks


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: now[0])
    return now


def test_the_bar_shows_one_rate_answered_per_second_of_generation(clock):
    progress = Progress(10, description="lines", unit="lines")
    progress.skip(2)  # two error lines: done, but not answered by the engine
    assert progress.rate() is None
    progress.start()
    clock[0] = 101.0
    progress.update(0, 5)
    clock[0] = 102.0
    progress.update(3, 7)
    assert progress.rate() == 1.5 and progress.num_answered == 3
    clock[0] = 200.0  # between answers (and after the last one) the rate holds
    assert progress.rate() == 1.5
    meter = str(progress._shown())
    assert meter.endswith("| 5/10 [00:00<00:03,  1.50 lines/s]"), meter
    assert meter.count("/s") == 1
    progress.close()


def test_the_summary_keeps_loading_apart_and_counts_saved_prefill():
    summary = BatchJobSummary("out.jsonl", num_requests=6, num_errors=1, num_prompt_tokens=1360,
                              num_output_tokens=120, num_steps=30, seconds=4.0, num_resumed=2, load_seconds=12.34,
                              num_answered_now=4, num_computed_prompt_tokens=400)
    assert summary.describe() == (
        "6 requests answered, 1 errors -> out.jsonl (2 resumed from an earlier run)\n"
        "model loaded in 12.3 s\n"
        "generation: 4.00 s, 1.00 requests/s, 30.0 generated tokens/s (30 steps)\n"
        "tokens: 1,360 prompt (400 computed: prefix sharing saved 960, 70.6%), 120 generated")
    uncounted = BatchJobSummary("out.jsonl", 6, 1, 1360, 120, 30, 4.0, num_answered_now=4)
    assert uncounted.describe().splitlines()[1:] == [
        "generation: 4.00 s, 1.00 requests/s, 30.0 generated tokens/s (30 steps)",
        "tokens: 1,360 prompt, 120 generated"]
    nothing_ran = BatchJobSummary("out.jsonl", 0, 3, 0, 0, 0, 0.0)
    assert nothing_ran.describe() == "0 requests answered, 3 errors -> out.jsonl"


@pytest.mark.parametrize("window", [None, 2])
def test_batchllm_run_reports_loading_generation_and_prefix_savings(tmp_path, capsys, window):
    lines = [json.dumps({"custom_id": f"r{i}", "prompt_token_ids": SHARED_PREFIX + [100 + i, 200 + i],
                         "max_tokens": 3, "temperature": 0, "ignore_eos": True}) for i in range(4)]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([*lines, "{bad"]) + "\n")
    args = ["run", str(path), "-o", str(tmp_path / "out.jsonl"), "--model", "random:tiny", "--no-progress",
            "--kv-cache-tokens", "512"] + (["--window", str(window)] if window else [])
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"4 requests answered, 1 errors -> {tmp_path / 'out.jsonl'}"
    assert out[1].startswith("model loaded in ") and out[1].endswith(" s")
    num_steps = 3 if window is None else 6  # 3 tokens a request, one window or two
    assert out[2].startswith("generation: ") and out[2].endswith(f"generated tokens/s ({num_steps} steps)")
    # 4 prompts of 34 tokens: the shared 32 computed once per window, each request's last 2 on its own
    computed = 32 + 4 * 2 if window is None else 2 * (32 + 2 * 2)
    saved = 136 - computed
    assert out[3] == f"tokens: 136 prompt ({computed} computed: prefix sharing saved {saved}, {saved / 136:.1%}), " \
                     "12 generated"
