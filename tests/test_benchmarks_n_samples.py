"""benchmarks/n_samples.py on a tiny model: a line of n samples processes its prompt once plus one
token per sample (the group's prefix is the prompt less its last token), as the same prompt
written n times does, and both runs generate the same tokens."""

from script_loader import load_benchmark_script

n_samples = load_benchmark_script("n_samples.py")


def test_n_samples_process_each_prompt_once_plus_a_token_per_sample(tmp_path):
    result = n_samples.main(["--model", "random:tiny", "--device", "cpu", "--requests", "6", "--prompt-tokens", "20",
                             "--output-tokens", "3", "--n", "4", "--repeat", "1", "--kv-cache-tokens", "4096",
                             "--out", str(tmp_path / "n.json")])
    sampled, lines = result["runs"]["n_samples"][0], result["runs"]["lines"][0]
    assert sampled["processed_prompt_tokens"] == lines["processed_prompt_tokens"] == 6 * 19 + 6 * 4
    assert sampled["output_tokens"] == lines["output_tokens"] == 6 * 4 * 3
    assert result["time_ratio_n_over_lines"] > 0
