"""Synthetic paged batches for tests and benchmarks: prefix-sharing groups laid out group by group.

Blocks are allocated per group prefix (shared, read-only) and per request (own), then
shuffled so physical blocks are not contiguous; block tables follow the addressing rule of
batchllm/sched/interface.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SeqSpec:
    q_len: int  # rows of the seq in this step
    seq_len: int  # KV positions visible to its last row
    shared_kv_len: int = 0
    group_id: int = -1
    is_prefix: bool = False


@dataclass
class SyntheticBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim] (the step's new rows)
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    shared_kv_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    group_ids: torch.Tensor  # [num_seqs] int32
    is_prefix: torch.Tensor  # [num_seqs] bool
    slot_mapping: torch.Tensor  # [num_tokens] int64: slots of the new rows

    def metadata_numpy(self) -> dict:
        return {name: getattr(self, name).cpu().numpy() for name in
                ("query_start_loc", "seq_lens", "shared_kv_lens", "block_tables", "group_ids", "is_prefix")}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def make_batch(seqs: list[SeqSpec], *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               dtype=torch.float32, device="cpu", seed: int = 0, spare_blocks: int = 2) -> SyntheticBatch:
    rng = np.random.default_rng(seed)
    prefix_len: dict[int, int] = {}
    for s in seqs:
        if s.group_id >= 0:
            prefix_len[s.group_id] = max(prefix_len.get(s.group_id, 0), s.seq_len if s.is_prefix else s.shared_kv_len)
    num_blocks = sum(_ceil_div(p, block_size) for p in prefix_len.values())
    for s in seqs:
        if not (s.group_id >= 0 and s.is_prefix):
            num_blocks += _ceil_div(s.shared_kv_len, block_size) * (s.group_id < 0)
            num_blocks += _ceil_div(s.seq_len - s.shared_kv_len, block_size)
    num_blocks += spare_blocks
    physical = rng.permutation(num_blocks).astype(np.int32)
    next_block = 0

    def take(n: int) -> list[int]:
        nonlocal next_block
        ids = physical[next_block:next_block + n].tolist()
        next_block += n
        return ids

    group_blocks = {g: take(_ceil_div(p, block_size)) for g, p in prefix_len.items()}
    tables = []
    for s in seqs:
        if s.group_id >= 0 and s.is_prefix:
            table = group_blocks[s.group_id][:_ceil_div(s.seq_len, block_size)]
        else:
            head = (group_blocks[s.group_id][:_ceil_div(s.shared_kv_len, block_size)] if s.group_id >= 0
                    else take(_ceil_div(s.shared_kv_len, block_size)))
            table = head + take(_ceil_div(s.seq_len - s.shared_kv_len, block_size))
        tables.append(table)
    max_blocks = max([len(t) for t in tables] + [1])
    block_tables = np.zeros((len(seqs), max_blocks), np.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = t
    q_lens = np.array([s.q_len for s in seqs], np.int64)
    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(query_start_loc[-1])
    # slots of the new rows (positions seq_len - q_len ..), by the addressing rule
    slots = []
    for s, table in zip(seqs, tables):
        shared = 0 if s.is_prefix else s.shared_kv_len
        own0 = _ceil_div(shared, block_size)
        for p in range(s.seq_len - s.q_len, s.seq_len):
            rel = p - shared
            slots.append(table[own0 + rel // block_size] * block_size + rel % block_size)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):  # generated on the device: benchmark caches are GBs
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    as_t = lambda a, dt: torch.as_tensor(np.asarray(a), dtype=dt, device=device)  # noqa: E731
    return SyntheticBatch(
        query=randn(num_tokens, num_heads, head_dim), key=randn(num_tokens, num_kv_heads, head_dim),
        value=randn(num_tokens, num_kv_heads, head_dim), k_cache=randn(*cache_shape), v_cache=randn(*cache_shape),
        query_start_loc=as_t(query_start_loc, torch.int32),
        seq_lens=as_t([s.seq_len for s in seqs], torch.int32),
        shared_kv_lens=as_t([s.shared_kv_len for s in seqs], torch.int32),
        block_tables=as_t(block_tables, torch.int32),
        group_ids=as_t([s.group_id for s in seqs], torch.int32),
        is_prefix=as_t([s.is_prefix for s in seqs], torch.bool),
        slot_mapping=as_t(np.array(slots, np.int64).reshape(-1), torch.int64),
    )
