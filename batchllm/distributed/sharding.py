"""Which slice of each full parameter a rank holds, and building a rank's shard.

Split (rank r of tp):
  qkv_proj      rows: heads [r*H/tp, (r+1)*H/tp) of q; this rank's KV heads of k and v
  gate_up_proj  rows: [r*I/tp, (r+1)*I/tp) of gate and the same of up
  o_proj        columns: this rank's q heads; down_proj columns: this rank's I slice
  embed_tokens, lm_head  rows: vocabulary slice r of ceil(V/tp) (the last one zero-padded)
  norms         replicated
KV heads (docs/scale-out.md): num_kv_heads/tp per rank, or with num_kv_heads < tp head
r*num_kv_heads//tp on rank r (each replicated on tp/num_kv_heads ranks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from batchllm.distributed.layers import TensorParallelLlama
from batchllm.models.config import ModelArchConfig
from batchllm.models.llama import LlamaForCausalLM


class UnsupportedShardingError(ValueError):
    """The architecture cannot be split evenly over this many ranks."""


@dataclass(frozen=True)
class ShardLayout:
    rank: int
    world_size: int
    full: ModelArchConfig
    shard: ModelArchConfig  # num_heads, num_kv_heads, intermediate_size, vocab_size per rank
    kv_head_start: int  # first KV head (of the full model) this rank holds


def shard_layout(full: ModelArchConfig, rank: int, world_size: int) -> ShardLayout:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    problems = []
    if full.num_heads % world_size:
        problems.append(f"num_heads={full.num_heads}")
    if full.intermediate_size % world_size:
        problems.append(f"intermediate_size={full.intermediate_size}")
    if full.num_kv_heads >= world_size and full.num_kv_heads % world_size:
        problems.append(f"num_kv_heads={full.num_kv_heads}")
    if full.num_kv_heads < world_size and world_size % full.num_kv_heads:
        problems.append(f"num_kv_heads={full.num_kv_heads} (fewer than tp and tp not a multiple of it)")
    if problems:
        raise UnsupportedShardingError(
            f"cannot split the model over tensor_parallel_size={world_size}: {', '.join(problems)} "
            "not divisible by it; choose a tensor parallel size that divides them")
    num_kv_heads = max(1, full.num_kv_heads // world_size)
    kv_head_start = rank * full.num_kv_heads // world_size if full.num_kv_heads < world_size else rank * num_kv_heads
    shard = dataclasses.replace(
        full, num_heads=full.num_heads // world_size, num_kv_heads=num_kv_heads,
        intermediate_size=full.intermediate_size // world_size, vocab_size=-(-full.vocab_size // world_size))
    return ShardLayout(rank, world_size, full, shard, kv_head_start)


def shard_tensor(name: str, full_tensor: Tensor, layout: ShardLayout) -> Tensor:
    """This rank's slice of the full parameter `name` (a view where possible)."""
    arch, shard, rank = layout.full, layout.shard, layout.rank
    head_dim = arch.head_dim
    if name in ("embed_tokens.weight", "lm_head.weight"):
        rows = shard.vocab_size
        piece = full_tensor[rank * rows : (rank + 1) * rows]
        if piece.shape[0] < rows:  # the last rank's padding rows: never looked up, logits cut off
            pad = full_tensor.new_zeros((rows - piece.shape[0],) + tuple(full_tensor.shape[1:]))
            piece = torch.cat((piece, pad))
        return piece
    if name.endswith("self_attn.qkv_proj.weight") or name.endswith("self_attn.qkv_proj.bias"):
        q_rows = shard.q_size
        kv_begin, kv_rows = layout.kv_head_start * head_dim, shard.kv_size
        q = full_tensor[rank * q_rows : (rank + 1) * q_rows]
        k = full_tensor[arch.q_size + kv_begin : arch.q_size + kv_begin + kv_rows]
        v_offset = arch.q_size + arch.kv_size
        v = full_tensor[v_offset + kv_begin : v_offset + kv_begin + kv_rows]
        return torch.cat((q, k, v))
    if name.endswith("mlp.gate_up_proj.weight"):
        rows = shard.intermediate_size
        gate = full_tensor[rank * rows : (rank + 1) * rows]
        up = full_tensor[arch.intermediate_size + rank * rows : arch.intermediate_size + (rank + 1) * rows]
        return torch.cat((gate, up))
    if name.endswith("self_attn.o_proj.weight"):
        return full_tensor[:, rank * shard.q_size : (rank + 1) * shard.q_size]
    if name.endswith("mlp.down_proj.weight"):
        return full_tensor[:, rank * shard.intermediate_size : (rank + 1) * shard.intermediate_size]
    if name.endswith("norm.weight"):
        return full_tensor
    raise KeyError(f"no sharding rule for parameter {name!r}")


def empty_shard(layout: ShardLayout, dtype: torch.dtype, device: torch.device, group) -> TensorParallelLlama:
    """The shard's modules with uninitialised storage on `device` (nothing of the full size)."""
    return TensorParallelLlama.empty(layout.shard, dtype, device, layout.full.vocab_size, layout.rank,
                                     layout.world_size, group)


@torch.no_grad()
def fill_shard(model: TensorParallelLlama, layout: ShardLayout, full_params: Iterator[tuple[str, Tensor]]) -> None:
    """Copy this rank's slice of every full parameter; raises if one is missing or unknown."""
    params = dict(model.named_parameters())
    filled = set()
    for name, full_tensor in full_params:
        if name not in params:
            raise KeyError(f"full parameter {name!r} has no place in the shard")
        piece = shard_tensor(name, full_tensor, layout)
        if piece.shape != params[name].shape:
            raise ValueError(f"{name}: shard slice {tuple(piece.shape)} != parameter {tuple(params[name].shape)}")
        params[name].copy_(piece)
        filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"shard parameters left unfilled: {missing[:8]}")


def random_full_params(config: ModelArchConfig, seed: int, dtype: torch.dtype,
                       device: torch.device) -> Iterator[tuple[str, Tensor]]:
    """The random preset's parameters one at a time, drawn exactly as presets.random_model draws
    them (same order, same generator): a shard of these equals the slice of the full random model,
    and only one full parameter exists at a time."""
    from batchllm.models.presets import fill_random_

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, meta_param in skeleton.named_parameters():
        full = torch.empty(meta_param.shape, dtype=dtype, device=device)
        fill_random_(name, full, generator)
        yield name, full
        del full


@dataclass
class LoadedShard:
    model: TensorParallelLlama
    layout: ShardLayout
    tokenizer_source: dict
    name: str


def load_shard(spec: str | None, dtype: torch.dtype, device: torch.device, rank: int, world_size: int,
               group=None) -> LoadedShard:
    """Sharding at load time. Random presets: each parameter is drawn on `device` and only its
    slice kept. Checkpoints: loaded whole on the CPU, sliced, and only the slice sent to `device`
    (a streaming safetensors reader would avoid the CPU copy of the full model; not done yet)."""
    from batchllm.models.presets import RANDOM_PREFIX, parse_random_spec

    if spec is not None and spec.startswith(RANDOM_PREFIX):
        random_spec = parse_random_spec(spec)
        layout = shard_layout(random_spec.config, rank, world_size)
        model = empty_shard(layout, dtype, device, group)
        fill_shard(model, layout, random_full_params(random_spec.config, random_spec.seed, dtype, device))
        return LoadedShard(model, layout, {"kind": "none"}, spec)
    from batchllm.models.loader import load_model

    loaded = load_model(spec, dtype=dtype, device="cpu")
    layout = shard_layout(loaded.config, rank, world_size)
    model = empty_shard(layout, dtype, device, group)
    fill_shard(model, layout, iter(loaded.model.named_parameters()))
    return LoadedShard(model, layout, loaded.tokenizer_source, loaded.name)
