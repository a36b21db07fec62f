"""Tensor parallelism on CPU (gloo, world size 2): the sharding maths and the engine.

A shard's forward must give the unsharded logits (atol 1e-5, float32), for the layouts that
matter: KV heads split, KV heads replicated (num_kv_heads < tp), fused qkv with bias, untied LM
head and a vocabulary that does not divide by tp. The TP=2 engine must give TP=1's tokens.
"""

from __future__ import annotations

import dataclasses
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from batchllm.config import ParallelConfig, TensorParallelConfig, engine_config
from batchllm.distributed.sharding import UnsupportedShardingError, empty_shard, fill_shard, shard_layout
from batchllm.distributed.tp_engine import rendezvous_store
from batchllm.engine.llm_engine import LLMEngine, PreparedRequest
from batchllm.engine.run_options import RunOptions
from batchllm.models.llama import LlamaForCausalLM
from batchllm.models.presets import PRESETS
from batchllm.sampling_params import SamplingParams

TINY = PRESETS["tiny"]
LAYOUTS = {
    "kv-split-tied": TINY,
    # num_kv_heads=1 < tp=2: the KV head is replicated; qwen2-style qkv bias; untied LM head;
    # vocab 509 is not a multiple of 2 (the last vocab shard is padded).
    "kv-replicated-bias-untied": dataclasses.replace(TINY, architecture="qwen2", num_kv_heads=1, qkv_bias=True,
                                                     tie_word_embeddings=False, vocab_size=509),
}


def shard_model(model: LlamaForCausalLM, rank: int, world_size: int) -> LlamaForCausalLM:
    """A loaded full model -> rank's shard on the model's device (the default process group)."""
    first = next(model.parameters())
    layout = shard_layout(model.config, rank, world_size)
    shard = empty_shard(layout, first.dtype, first.device, None)
    fill_shard(shard, layout, iter(model.named_parameters()))
    return shard


def _full_model(config, seed: int = 0):
    """A float32 model with weights large enough that logits differ visibly between tokens."""
    model = LlamaForCausalLM.empty(config, torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * (0.3 if "norm" not in name else 0.1) +
                        (1.0 if "norm" in name else 0.0))
    return model


def _dense_causal_attention(num_heads: int, num_kv_heads: int):
    def attention(layer_index, query, key, value):  # [T, H, D], [T, KV, D]
        repeat = num_heads // num_kv_heads
        k = key.repeat_interleave(repeat, dim=1).transpose(0, 1)
        v = value.repeat_interleave(repeat, dim=1).transpose(0, 1)
        out = F.scaled_dot_product_attention(query.transpose(0, 1), k, v, is_causal=True)
        return out.transpose(0, 1)
    return attention


def _shard_worker(rank: int, world_size: int, store_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        input_ids = torch.tensor([5, 17, 300, 2, 99, 508, 0, 41, 7, 250], dtype=torch.int64)
        positions = torch.arange(input_ids.numel())
        for name, config in LAYOUTS.items():
            full = _full_model(config)
            full.rotary.ensure_capacity(64, torch.device("cpu"))
            with torch.inference_mode():
                expected = full.compute_logits(full(input_ids, positions,
                                                    _dense_causal_attention(config.num_heads, config.num_kv_heads)))
            shard = shard_model(full, rank, world_size)
            local = shard_layout(config, rank, world_size).shard
            shard.rotary.ensure_capacity(64, torch.device("cpu"))
            with torch.inference_mode():
                got = shard.compute_logits(shard(input_ids, positions,
                                                 _dense_causal_attention(local.num_heads, local.num_kv_heads)))
            assert got.shape == expected.shape == (input_ids.numel(), config.vocab_size), name
            assert expected.std() > 0.1, name  # logits are not all alike
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=name)
            assert torch.equal(got.argmax(-1), expected.argmax(-1)), name
    finally:
        dist.destroy_process_group()


def test_sharded_forward_equals_unsharded_logits(tmp_path):
    # A file rendezvous: a port found free and bound later can be taken in between by a test
    # running beside this one (EADDRINUSE).
    mp.spawn(_shard_worker, args=(2, str(tmp_path / "rendezvous")), nprocs=2, join=True)


def test_rendezvous_port_is_held_before_any_worker_starts():
    store = rendezvous_store(0, None, 2, 30.0)
    assert store.port > 0
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, pytest.raises(OSError):
        sock.bind(("127.0.0.1", store.port))


def test_shard_layout_kv_heads_and_errors():
    split = shard_layout(PRESETS["llama-3.1-70b"], 1, 2).shard
    assert (split.num_heads, split.num_kv_heads, split.intermediate_size, split.vocab_size) == (32, 4, 14336, 64128)
    replicated = [shard_layout(dataclasses.replace(TINY, num_kv_heads=1), r, 2) for r in range(2)]
    assert [(s.shard.num_kv_heads, s.kv_head_start) for s in replicated] == [(1, 0), (1, 0)]
    four = [shard_layout(dataclasses.replace(TINY, num_heads=8), r, 4).kv_head_start for r in range(4)]
    assert four == [0, 0, 1, 1]  # q heads 2r, 2r+1 belong to KV head r // 2
    with pytest.raises(UnsupportedShardingError, match="num_heads=4"):
        shard_layout(TINY, 0, 3)


def _requests() -> list[PreparedRequest]:
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 500, 40).tolist()
    requests = []
    for i in range(6):
        prompt = prefix + rng.integers(3, 500, 5 + i).tolist() if i < 4 else rng.integers(3, 500, 20).tolist()
        # Greedy and seeded sampling (random:tiny's greedy tokens are nearly constant; sampled ones
        # are not); lengths differ, so requests finish at different steps.
        params = SamplingParams(max_tokens=4 + 2 * i, temperature=0.0 if i % 2 else 1.0, seed=100 + i,
                                ignore_eos=True)
        requests.append(PreparedRequest(i, prompt, params))
    return requests


def test_tp2_engine_equals_tp1():
    """Both step loops (synchronous and asynchronous scheduling), a second batch, and a batch the
    caller abandons after its first output: every rank must end that run at the same step, or the
    next run's collectives would pair with the old run's."""
    from batchllm.engines import build_engine

    config = engine_config("random:tiny?seed=3", dtype="float32", device="cpu", kv_cache_tokens=2048)
    single = {o.request_id: o.output_token_ids for o in LLMEngine(config).run(_requests())}
    tensor = TensorParallelConfig(size=2, timeout_s=120)
    with build_engine(dataclasses.replace(config, parallel=ParallelConfig(tensor=tensor))) as engine:
        assert engine.kv_cache.k.shape[3] == 1  # this rank holds 1 of the 2 KV heads
        split = {o.request_id: o.output_token_ids for o in engine.run(_requests())}
        in_step = {o.request_id: o.output_token_ids
                   for o in engine.run(_requests(), options=RunOptions(async_scheduling=False))}
        abandoned = engine.run(_requests())
        first = next(abandoned)
        abandoned.close()
        again = {o.request_id: o.output_token_ids for o in engine.run(_requests()[:2])}
        steps_launched = engine.gate.next_step
    assert split == single and in_step == single
    assert first.output_token_ids == single[first.request_id]
    assert again == {0: single[0], 1: single[1]}
    assert len({tuple(t) for t in single.values()}) == 6  # the comparison is not trivial
    assert steps_launched > 3 * 10  # three whole runs of at least 10 steps each, plus the abandoned one
