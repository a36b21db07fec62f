"""`batchllm run --tensor-parallel-size 2` (gloo on CPU) answers like a single process."""

import json
import subprocess
import sys


ARGS = ["--model", "random:tiny?vocab_size=512", "--device", "cpu", "--kv-cache-tokens", "1024", "--no-progress"]


def _run(tmp_path, name, *extra):
    """`batchllm run` as its own process (the tensor-parallel workers are processes of their own)."""
    output = tmp_path / f"{name}.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "batchllm.cli.main", "run", str(tmp_path / "in.jsonl"), "-o", str(output), *ARGS,
         *extra],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in output.read_text().splitlines()]


def test_tensor_parallel_cli_matches_single_process(tmp_path):
    from batchllm.cli.main import main

    lines = [{"custom_id": f"r{i}", "prompt_token_ids": [7 + i, 9, 11, 13 + i], "max_tokens": 6, "temperature": 0,
              "ignore_eos": True} for i in range(4)]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert main(["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "single.jsonl"), *ARGS]) == 0
    single = [json.loads(line) for line in (tmp_path / "single.jsonl").read_text().splitlines()]
    split = _run(tmp_path, "tp2", "--tensor-parallel-size", "2")
    texts = lambda records: [(r["custom_id"], r["response"]["body"]["usage"]) for r in records]  # noqa: E731
    assert texts(split) == texts(single)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 6 for r in split)


def test_llm_tensor_parallel_size_gives_the_same_tokens():
    from batchllm import LLM, SamplingParams

    prompts = [[7 + i, 9, 11, 13 + i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kwargs = dict(model="random:tiny?vocab_size=512", device="cpu", kv_cache_tokens=1024)
    single = [o.outputs[0].token_ids for o in LLM(**kwargs).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**kwargs, tensor_parallel_size=2)
    try:
        assert llm.engine.config.parallel.tensor.size == 2
        split = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert split == single
