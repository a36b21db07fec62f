"""A Hugging Face model id (`org/name`) loads from the local Hugging Face cache, never from the
network; an id that is not cached is refused with the command that downloads it."""

import json

import huggingface_hub
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from batchllm.cli.main import main
from batchllm.job.job_identity import model_fingerprint
from batchllm.models.loader import load_model
from batchllm.models.model_path import find_model_files, tokenizer_source
from batchllm.models.refusals import ModelNotFoundError
from model_helpers import run_flat

pytest_plugins = ["model_fixtures"]

MODEL_ID = "Org/Tiny-Llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache (huggingface_hub's layout) that huggingface_hub looks in."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a test that reached for the network fails instead
    return cache


def _cache_model(cache, model_id: str, vocab_size: int = 300):
    """A tiny random Llama checkpoint as `hf download model_id` leaves it (refs/main -> snapshot)."""
    repo = cache / f"models--{model_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(snapshot, safe_serialization=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_a_cached_model_id_loads_its_snapshot(hf_cache):
    snapshot = _cache_model(hf_cache, MODEL_ID)
    files = find_model_files(MODEL_ID)
    assert (files.kind, files.path, files.name) == ("hf_dir", snapshot, MODEL_ID)
    assert tokenizer_source(MODEL_ID) == {"kind": "hf_dir", "path": str(snapshot)}
    by_id, by_path = load_model(MODEL_ID), load_model(str(snapshot))
    assert by_id.name == MODEL_ID and by_id.tokenizer_source == {"kind": "hf_dir", "path": str(snapshot)}
    (ours,), (reference,) = run_flat(by_id, [[5, 6, 7, 8]]), run_flat(by_path, [[5, 6, 7, 8]])
    assert torch.equal(ours, reference)
    # the journal identifies the model by its snapshot's files
    assert model_fingerprint(MODEL_ID) == model_fingerprint(str(snapshot)) is not None


def test_a_local_path_wins_over_a_model_id(hf_cache, tmp_path, monkeypatch):
    _cache_model(hf_cache, MODEL_ID)
    local = tmp_path / "Org" / "Tiny-Llama"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert find_model_files(MODEL_ID).path.resolve() == local.resolve()


def test_an_id_that_is_not_cached_names_the_download(hf_cache, tmp_path, capsys):
    with pytest.raises(ModelNotFoundError) as raised:
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    message = (f"model 'HuggingFaceTB/SmolLM2-135M-Instruct' is neither a path nor a model in the local Hugging Face "
               f"cache ({hf_cache}) (fix: download it first with `hf download HuggingFaceTB/SmolLM2-135M-Instruct`: "
               "batchllm never downloads)")
    assert str(raised.value) == message
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"custom_id": "a", "prompt_token_ids": [1, 2], "max_tokens": 2}) + "\n")
    code = main(["run", str(path), "-o", str(tmp_path / "out.jsonl"), "--no-progress",
                 "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"])
    assert code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: cannot load the model HuggingFaceTB/SmolLM2-135M-Instruct: {message}")


@pytest.mark.default_model
def test_batchllm_run_answers_with_a_cached_model_id(hf_cache, tmp_path, session_default_llm):
    """The whole path: a cached checkpoint with its tokenizer (the default model's, saved as
    tokenizer.json), a chat line answered, the response naming the model id."""
    tokenizer = session_default_llm.engine.tokenizer.hf
    snapshot = _cache_model(hf_cache, MODEL_ID, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(snapshot)
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}}) + "\n")
    output = tmp_path / "out.jsonl"
    assert main(["run", str(path), "-o", str(output), "--no-progress", "--model", MODEL_ID, "--device", "cpu",
                 "--kv-cache-tokens", "256"]) == 0
    (record,) = [json.loads(line) for line in output.read_text().splitlines()]
    body = record["response"]["body"]
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    assert body["model"] == MODEL_ID
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 3,
                             "total_tokens": len(prompt_ids) + 3, "prompt_tokens_details": {"cached_tokens": 0}}
