"""Workload generator: shapes, exact micro saving ratios, industrial means, uniform prompts, JSONL."""

import io
import json
import subprocess
import sys

import numpy as np
import pytest

from batchllm.prefix import plan_prefix_arrays
from batchllm.perf.workload import make_workload, split_workload_spec
from batchllm.perf.workloads import industrial_workload, micro_workload, token_ids_to_text, uniform_workload, write_jsonl


def test_micro_shapes_and_shuffle():
    workload = micro_workload(20, 5, 4, num_requests=10, seed=3)
    assert workload.num_requests == 10
    assert all(p.size == 25 and p.dtype == np.int32 for p in workload.prompts)
    assert workload.max_tokens == (100,) * 10
    assert len(set(workload.custom_ids)) == 10
    # 3 groups (4 + 4 + 2); shuffled so that neighbours are not all from one group.
    prefixes = [tuple(p[:20].tolist()) for p in workload.prompts]
    assert sorted(prefixes.count(x) for x in set(prefixes)) == [2, 4, 4]
    again = micro_workload(20, 5, 4, num_requests=10, seed=3)
    assert all((a == b).all() for a, b in zip(workload.prompts, again.prompts))


@pytest.mark.parametrize(
    "prefix, distinct, sharing_degree, expected_ratio",
    [
        (2000, 200, 16, 15 * 2000 / (16 * 2200)),  # 85.2%: the paper's upper bound (6.2.3)
        (2000, 200, 4, 3 * 2000 / (4 * 2200)),
        (1000, 1000, 4, 3 * 1000 / (4 * 2000)),
        (16000, 200, 16, 15 * 16000 / (16 * 16200)),  # 92.6% in the paper
    ],
)
def test_micro_sets_reach_the_upper_bound(prefix, distinct, sharing_degree, expected_ratio):
    workload = micro_workload(prefix, distinct, sharing_degree, num_requests=16 * sharing_degree)
    stats = plan_prefix_arrays(list(workload.prompts)).stats
    assert stats.saved_prefill_tokens == 16 * (sharing_degree - 1) * prefix
    assert stats.saving_ratio == pytest.approx(expected_ratio)
    assert stats.num_shared_groups == 16


def test_micro_2000_200_sd16_is_85_2_percent():
    stats = plan_prefix_arrays(list(micro_workload(2000, 200, 16, num_requests=2000).prompts)).stats
    assert round(100 * stats.saving_ratio, 1) == 85.2


def test_industrial_means_match_the_paper():
    workload = industrial_workload(num_requests=8000, seed=0)
    assert workload.num_requests == 8000
    lengths = np.array([p.size for p in workload.prompts])
    # mean prompt = mean prefix (~1570) + mean distinct (~30)
    assert 1450 < lengths.mean() < 1750
    assert np.median(lengths) < lengths.mean()  # skewed (lognormal)
    stats = plan_prefix_arrays(list(workload.prompts)).stats
    assert stats.saving_ratio_multi_level >= stats.saving_ratio > stats.saving_ratio_naive_first_level
    assert 0.5 < stats.saving_ratio < 0.8


def test_industrial_document_sharing_degree_is_about_3():
    workload = industrial_workload(num_requests=6000, num_instruction_templates=1, instruction_num_tokens=0, seed=1)
    # No template: the optimal groups are the documents (sd ~ geometric, mean 3).
    stats = plan_prefix_arrays(list(workload.prompts)).stats
    mean_degree = workload.num_requests / (stats.num_shared_groups + stats.num_singletons)
    assert 2.5 < mean_degree < 3.5


def test_uniform_prompts_share_no_prefix():
    workload = uniform_workload(16, 9, 150, vocab_size=1200, low_token_id=1000, seed=2)
    assert workload.name == "uniform-16/9"
    assert workload.max_tokens == (9,) * 150
    assert all(p.size == 16 and p.dtype == np.int32 for p in workload.prompts)
    assert all(1000 <= p.min() and p.max() < 1200 for p in workload.prompts)
    assert len({int(p[0]) for p in workload.prompts}) == 150  # fewer prompts than ids: first tokens differ
    assert plan_prefix_arrays(list(workload.prompts)).stats.saved_prefill_tokens == 0
    again = uniform_workload(16, 9, 150, vocab_size=1200, low_token_id=1000, seed=2)
    assert all((a == b).all() for a, b in zip(workload.prompts, again.prompts))


def test_uniform_spec_and_its_default_request_counts():
    assert split_workload_spec("uniform:128:128", 512) == ("uniform:128:128", 30_000)
    assert split_workload_spec("uniform:2048:128", 512) == ("uniform:2048:128", 3_000)
    assert split_workload_spec("uniform:1000:1000", 512) == ("uniform:1000:1000", 3_000)
    assert split_workload_spec("uniform:5000:500", 512) == ("uniform:5000:500", 1_500)
    assert split_workload_spec("uniform:20000:2000", 512) == ("uniform:20000:2000", 1_000)
    assert split_workload_spec("uniform:128:128#64", 512) == ("uniform:128:128", 64)
    assert split_workload_spec("uniform:100:10", 512) == ("uniform:100:10", 512)
    workload = make_workload("uniform:12:7", 5, 100, 32000, 0)  # OSL from the spec, not output_tokens
    assert workload.max_tokens == (7,) * 5 and {p.size for p in workload.prompts} == {12}
    for bad in ("uniform:12", "uniform:a:7", "uniform:0:7"):
        with pytest.raises(SystemExit, match="uniform:ISL:OSL|ISL and OSL"):
            make_workload(bad, 5, 100, 32000, 0)


def test_jsonl_token_ids_and_text():
    workload = micro_workload(3, 2, 2, num_requests=4)
    stream = io.StringIO()
    assert write_jsonl(workload, stream) == 4
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert records[0].keys() == {"custom_id", "prompt_token_ids", "max_tokens"}
    assert records[0]["prompt_token_ids"] == workload.prompts[0].tolist()
    text = io.StringIO()
    write_jsonl(workload, text, text=True)
    first = json.loads(text.getvalue().splitlines()[0])
    assert first["prompt"] == token_ids_to_text(workload.prompts[0])
    assert first["prompt"].split()[0] == f"w{workload.prompts[0][0]}"


def test_bad_parameters():
    with pytest.raises(ValueError):
        micro_workload(10, 0, 4)
    with pytest.raises(ValueError):
        industrial_workload(num_requests=10, mean_sharing_degree=0.5)
    with pytest.raises(ValueError):
        uniform_workload(0, 10, 4)


def test_module_cli_writes_a_file(tmp_path):
    path = tmp_path / "micro.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "batchllm.perf.workloads", "micro", "--prefix", "8", "--distinct", "2",
         "--sd", "2", "-n", "6", "-o", str(path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert len(path.read_text().splitlines()) == 6


def test_module_cli_writes_a_uniform_file(tmp_path):
    path = tmp_path / "uniform.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "batchllm.perf.workloads", "uniform", "--isl", "5", "--max-tokens", "3", "-n", "4",
         "-o", str(path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(len(r["prompt_token_ids"]), r["max_tokens"]) for r in records] == [(5, 3)] * 4
