"""Sliding-window attention (Mistral, Qwen2): the window read from config.json, the reference
masks as HF transformers masks, and greedy generation past the window equal to HF's."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config
from transformers.masking_utils import sliding_window_overlay

from batchllm import LLM, SamplingParams
from batchllm.models.hf_loader import hf_arch_config
from batchllm.ops.reference import paged_attention_reference, visible_kv
from op_references import dense_causal_attention, prefix_shared_attention_reference

WINDOW = 16
COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def test_visible_kv_is_transformers_sliding_window_mask():
    overlay = sliding_window_overlay(WINDOW)
    q_positions = torch.arange(40)
    ours = visible_kv(torch.arange(40), q_positions, WINDOW)
    theirs = torch.tensor([[kv <= q and overlay(0, 0, q, kv) for kv in range(40)] for q in range(40)])
    assert torch.equal(ours, theirs)
    assert ours[39].nonzero().flatten().tolist() == list(range(24, 40))  # the last 16 positions, itself included


def test_window_read_from_config_json(tmp_path):
    MistralConfig(**COMMON, sliding_window=WINDOW).save_pretrained(tmp_path / "mistral")
    assert hf_arch_config(tmp_path / "mistral").layer_windows == (WINDOW, WINDOW)
    MistralConfig(**COMMON, sliding_window=None).save_pretrained(tmp_path / "full")
    assert hf_arch_config(tmp_path / "full").layer_windows == ()
    Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1).save_pretrained(
        tmp_path / "qwen2")
    assert hf_arch_config(tmp_path / "qwen2").layer_windows == (None, WINDOW)
    Qwen2Config(**COMMON, use_sliding_window=False, sliding_window=WINDOW).save_pretrained(tmp_path / "qwen2-off")
    assert hf_arch_config(tmp_path / "qwen2-off").layer_windows == ()
    LlamaConfig(**COMMON).save_pretrained(tmp_path / "llama")
    raw = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**raw, "sliding_window": WINDOW}))
    assert hf_arch_config(tmp_path / "llama").layer_windows == ()


def _paged_case(generator, seq_lens, q_lens, shared_lens, block_size=4, num_kv_heads=2, group=2, head_dim=8):
    """A random paged step whose seqs share their first shared_lens positions with seq 0."""
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    free = iter(torch.randperm(num_blocks, generator=generator).tolist())
    shared_blocks = [next(free) for _ in range(-(-max(shared_lens) // block_size))]
    tables = []
    for seq_len, shared in zip(seq_lens, shared_lens):
        own = -(-(seq_len - shared) // block_size)
        tables.append(shared_blocks[: -(-shared // block_size)] + [next(free) for _ in range(own)])
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=generator)
    starts = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return query, k_cache, v_cache, starts, torch.tensor(seq_lens, dtype=torch.int32), \
        torch.tensor(shared_lens, dtype=torch.int32), block_tables


def test_paged_and_prefix_references_equal_dense_with_a_window():
    generator = torch.Generator().manual_seed(0)
    seq_lens, q_lens, shared_lens = [45, 30, 60, 9], [1, 30, 5, 9], [24, 24, 24, 0]
    case = _paged_case(generator, seq_lens, q_lens, shared_lens)
    query, k_cache, v_cache, starts, lens, shared, tables = case
    paged = paged_attention_reference(*case, scale=0.3, sliding_window=WINDOW)
    grouped = prefix_shared_attention_reference(*case, torch.tensor([0, 0, 0, -1]), torch.zeros(4, dtype=torch.bool),
                                                scale=0.3, sliding_window=WINDOW)
    for s, (seq_len, q_len, shared_len) in enumerate(zip(seq_lens, q_lens, shared_lens)):
        from batchllm.ops.reference import kv_slots_of_seq

        slots = kv_slots_of_seq(tables[s], seq_len, shared_len, 4)
        key, value = k_cache.view(-1, 2, 8)[slots], v_cache.view(-1, 2, 8)[slots]
        rows = slice(int(starts[s]), int(starts[s + 1]))
        dense = dense_causal_attention(query[rows], key, value, 0.3, sliding_window=WINDOW)
        torch.testing.assert_close(paged[rows], dense, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grouped[rows], dense, atol=1e-5, rtol=1e-5)
        full = dense_causal_attention(query[rows], key, value, 0.3)
        if seq_len > WINDOW:
            assert not torch.allclose(full, dense)  # the window changes these rows


def test_torch_backend_equals_the_reference_with_a_window():
    from types import SimpleNamespace

    import numpy as np

    from batchllm.engine.attention.batched_torch import BatchedTorchBackend

    generator = torch.Generator().manual_seed(3)
    case = _paged_case(generator, [45, 30, 60, 9, 17], [1, 30, 5, 9, 1], [24, 24, 24, 0, 0])
    query, k_cache, v_cache, starts, lens, shared, tables = case
    inputs = SimpleNamespace(query_start_loc=starts.numpy(), seq_lens=lens.numpy(), shared_kv_lens=shared.numpy(),
                             block_tables=tables.numpy())
    backend = BatchedTorchBackend(block_size=4)
    plan = backend.plan_to_device(backend.build_plan(inputs), torch.device("cpu"))
    metadata = SimpleNamespace(slot_mapping=torch.zeros(1, dtype=torch.int64), plan=plan)
    assert len(metadata.plan) > 1  # decode rows and prefill chunks in separate padded batches
    for window in (None, WINDOW, 1):
        ours = backend.attend(query, k_cache, v_cache, metadata, 0.3, window)
        expected = paged_attention_reference(*case, scale=0.3, sliding_window=window)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert np.array_equal(inputs.seq_lens, lens.numpy())


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mistral-window")
    torch.manual_seed(0)
    config = MistralConfig(**COMMON, sliding_window=WINDOW, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.3 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    _save_word_tokenizer(directory, COMMON["vocab_size"])
    return directory, model


def _save_word_tokenizer(directory, vocab_size):
    """A word-level tokenizer ("t0" .. "t<vocab_size - 1>") so the directory loads as a whole model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", eos_token="t2").save_pretrained(directory)


def _prompts():
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 300, (40,), generator=generator).tolist()  # a shared prefix past the window
    prompts = [shared + torch.randint(3, 300, (n,), generator=generator).tolist() for n in (20, 22, 25, 18)]
    return prompts + [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (60, 58, 63, 61)]


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_greedy_tokens_equal_transformers_past_the_window(mistral_dir, backend):
    directory, hf_model = mistral_dir
    prompts = _prompts()
    max_tokens = 12
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                          min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            expected.append(generated[0, len(prompt):].tolist())
        # Full attention gives other tokens for most prompts: the test sees the window.
        full = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, sliding_window=None).eval()
        differs = sum(full.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                    pad_token_id=0)[0, len(p):].tolist() != e for p, e in zip(prompts, expected))
    assert differs >= len(prompts) // 2
    llm = LLM(str(directory), dtype="float32", device="cpu", kv_cache_tokens=2048, attention_backend=backend,
              max_num_batched_tokens=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


# --- Triton kernels (interpreter on CPU) against the references --------------------------------

KERNEL_SCENARIOS = {
    # decodes of a 21-token prefix group, rows far past the prefix: windows cut into the prefix
    "decode_past_prefix": ["1,22,21,0", "1,40,21,0", "1,64,21,0", "1,45,0,-1"],
    # the prefix chunk with its members' first chunks, an ungrouped prefill chunk
    "prefix_with_chunks": ["13,21,0,0,p", "6,27,21,0", "3,24,21,0", "17,17,0,-1"],
    # ragged mix with an ungrouped seq still reading shared blocks
    "mixed_ragged": ["5,16,0,3,p", "1,40,16,3", "2,18,16,3", "11,30,0,-1", "1,50,17,-1", "3,26,21,5",
                     "1,61,21,5"],
}


def _kernel_case(name, dtype, window, device, tile=None, kv_split_tokens=16):
    from batchllm.attention_plan.work_list import build_prefix_shared_plan
    from batchllm.ops.plan_device import device_num_sms, plan_to_device
    from batchllm.ops.prefix_attention import prefix_shared_attention
    from synthetic_batch import SeqSpec, make_batch

    seqs = []
    for spec in KERNEL_SCENARIOS[name]:
        q_len, seq_len, shared, group, *prefix = spec.split(",")
        seqs.append(SeqSpec(int(q_len), int(seq_len), int(shared), int(group), bool(prefix)))
    b = make_batch(seqs, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype, device=device)
    plan = build_prefix_shared_plan(**b.metadata_numpy(), block_size=16, num_kv_heads=3, num_heads=9, head_dim=64,
                                    kv_split_tokens=kv_split_tokens, tile=tile, num_sms=device_num_sms(device))
    q_lens = b.query_start_loc[1:] - b.query_start_loc[:-1]
    positions = torch.cat([torch.arange(int(n) - int(q), int(n)) for q, n in zip(q_lens, b.seq_lens)]).to(device)
    out = prefix_shared_attention(b.query, b.k_cache, b.v_cache, plan_to_device(plan, device), 0.125, window, positions)
    args = (b.query.float(), b.k_cache.float(), b.v_cache.float(), b.query_start_loc, b.seq_lens, b.shared_kv_lens,
            b.block_tables)
    ref = paged_attention_reference(*args, 0.125, sliding_window=window)
    grouped_ref = prefix_shared_attention_reference(*args, b.group_ids, b.is_prefix, 0.125, sliding_window=window)
    torch.testing.assert_close(grouped_ref, ref, atol=1e-5, rtol=1e-5)
    return out.float(), ref, args


@pytest.mark.parametrize("name", sorted(KERNEL_SCENARIOS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("window", [5, 20])
def test_fused_kernel_window_matches_reference(name, dtype, tol, window, device):
    out, ref, args = _kernel_case(name, dtype, window, device)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    full = paged_attention_reference(*args, 0.125)
    assert not torch.allclose(ref, full, atol=1e-3)  # the window changes some rows


@pytest.mark.parametrize("name", ["prefix_with_chunks", "mixed_ragged"])
def test_window_with_unmasked_kv_steps(name, device):
    """BLOCK_N 8 with no KV split: tiles hold steps below the window (skipped), steps some rows
    see (masked) and steps every row sees (unmasked)."""
    from dataclasses import replace

    from batchllm.attention_plan.tile_config import default_tile_config

    tile = replace(default_tile_config(64, 3), small_n=16, big_n=16)
    out, ref, _ = _kernel_case(name, torch.float32, 17, device, tile=tile, kv_split_tokens=None)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["prefix_with_chunks", "mixed_ragged"])
def test_window_wider_than_every_context_equals_no_window(name, device):
    """Without a window the kernel is compiled without its window path (WINDOWED=False). A window
    wider than every context runs the windowed variant over the same KV steps: the two outputs are
    bit-equal, so the variants differ only in what the window hides."""
    out_no_window, ref, _ = _kernel_case(name, torch.float32, None, device)
    out_wide, _, _ = _kernel_case(name, torch.float32, 10_000, device)
    assert torch.equal(out_no_window, out_wide)
    torch.testing.assert_close(out_no_window, ref, atol=2e-5, rtol=2e-5)


def test_paged_kernel_window_matches_reference(device):
    from op_references import paged_attention

    generator = torch.Generator().manual_seed(4)
    case = tuple(t.to(device) for t in _paged_case(generator, [45, 30, 60, 9], [1, 30, 5, 9], [24, 24, 24, 0],
                                                   block_size=16, num_kv_heads=2, group=2, head_dim=16))
    for window in (None, 3, WINDOW):
        out = paged_attention(*case, 0.25, sliding_window=window)
        torch.testing.assert_close(out, paged_attention_reference(*case, 0.25, sliding_window=window),
                                   atol=2e-5, rtol=2e-5)
