"""Per-part tile sizes of the attention kernels: a small hand table keyed on shapes.

Two tile classes live in one launch (BatchLLM section 5, "per-part tile sizes"): SMALL tiles
for decode-like work (a request's single row x its KV: GQA heads packed into M = 16) and BIG
tiles for MatMul-like work (a group's rows x its shared prefix, prefill chunks). The host
assigns each work item a class from its packed row count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from batchllm.ops.validation import next_power_of_2


@dataclass(frozen=True)
class TileConfig:
    small_m: int  # packed (token x GQA head) rows of a small tile
    small_n: int  # KV positions per inner step of a small tile
    big_m: int
    big_n: int
    num_warps: int
    num_stages: int
    min_kv_split_tokens: int  # never split a KV range into pieces shorter than this
    # CUDA graphs freeze the launch grid at capture while a decode step's item count varies, so
    # graph launches are persistent: this many programs per SM stride over the step's items
    # (before: one program per item of the graph's padded capacity; on micro 2000/200 sd16 a
    # tail decode step of 96 rows ran 12,288 programs for 960 real ones)
    graph_programs_per_sm: int = 4
    # run BIG and SMALL items as two launches of class-specialised kernel variants (CLASSES 2
    # then 1), each compiled for one tile class only, so the SMALL (decode) launch gets the
    # registers and shared memory of a SMALL tile (more programs per SM) and its own warps /
    # stages (None: num_warps / num_stages); persistent in CUDA graphs, where the fused kernel
    # would spill (decode_tile_config)
    split_classes: bool = False
    small_num_warps: int | None = None
    small_num_stages: int | None = None

    @property
    def kv_split_multiple(self) -> int:
        return max(self.small_n, self.big_n)


def running_in_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_tile_config(head_dim: int, group_size: int, interpret: bool | None = None) -> TileConfig:
    """Hand-tuned table; the interpreter (CPU tests) always gets one small config."""
    if interpret is None:
        interpret = running_in_interpreter()
    packed_min = max(16, next_power_of_2(group_size))
    if interpret:
        return TileConfig(small_m=packed_min, small_n=16, big_m=max(32, packed_min), big_n=16,
                          num_warps=4, num_stages=1, min_kv_split_tokens=16)
    if head_dim <= 64:
        return TileConfig(small_m=packed_min, small_n=64, big_m=max(64, packed_min), big_n=64,
                          num_warps=4, num_stages=3, min_kv_split_tokens=256)
    # H200, Llama-3.1-8B heads, bf16: best of candidate_tile_configs on every setting of
    # benchmarks/attention.py (benchmarks/results/attention.json, config "cfg1")
    return TileConfig(small_m=packed_min, small_n=128, big_m=max(64, packed_min), big_n=64,
                      num_warps=4, num_stages=2, min_kv_split_tokens=512)


def decode_tile_config(head_dim: int, group_size: int, interpret: bool | None = None) -> TileConfig:
    """Tiles of decode-only steps (the engine's CUDA-graph steps): the default table with the BIG
    and SMALL items in two class-specialised launches, the SMALL one streaming KV in BLOCK_N 64
    steps. Made persistent for graphs, the fused kernel spills (255 registers + stack on sm_90);
    the class-specialised variants do not. On the H200 (benchmarks/engine_steps.py, real decode
    steps of micro 2000/200 sd16 timed inside CUDA graphs) the class-split persistent launches
    took 4-14% less time than the persistent fused launch for batchllm's steps and 11-16% less
    for plain paged plans. On steps with prefill chunks (eager) the split was 1% slower for
    batchllm on geometric mean (-7% to +5%), so those keep the fused launch (default_tile_config)."""
    from dataclasses import replace

    base = default_tile_config(head_dim, group_size, interpret)
    if base.small_n < 64:  # the interpreter's tiny config (CPU tests): only the split
        return replace(base, split_classes=True)
    return replace(base, split_classes=True, small_n=64, small_num_warps=4, small_num_stages=2)


def candidate_tile_configs(head_dim: int, group_size: int) -> list[TileConfig]:
    """A few GPU configs the benchmark sweeps (the 'autotune' step, done once per shape)."""
    packed_min = max(16, next_power_of_2(group_size))
    return [
        TileConfig(small_m=packed_min, small_n=64, big_m=max(64, packed_min), big_n=64,
                   num_warps=4, num_stages=2, min_kv_split_tokens=256),
        TileConfig(small_m=packed_min, small_n=128, big_m=max(64, packed_min), big_n=64,
                   num_warps=4, num_stages=2, min_kv_split_tokens=512),
        TileConfig(small_m=packed_min, small_n=64, big_m=max(128, packed_min), big_n=64,
                   num_warps=8, num_stages=2, min_kv_split_tokens=256),
    ]


def prefill_tile_candidates(head_dim: int, group_size: int) -> dict[str, TileConfig]:
    """Named configs swept by benchmarks/prefill_tiles.py on steps with prefill chunks and on
    decode steps: the BIG tiles carry most of a prefill step's attention work, so larger MMA
    tiles / more warps may pay even though the SMALL (decode) tiles of the same launch share the
    warp count; decode steps stream KV, where pipeline depth (num_stages) and BLOCK_N matter."""
    from dataclasses import replace

    packed_min = max(16, next_power_of_2(group_size))
    base = default_tile_config(head_dim, group_size, interpret=False)
    return {
        "default": base,
        "s3": replace(base, num_stages=3),
        "sn64_s3": replace(base, small_n=64, num_stages=3),
        "sn64_s4": replace(base, small_n=64, num_stages=4),
        "m128_w8": TileConfig(small_m=packed_min, small_n=128, big_m=max(128, packed_min), big_n=64,
                              num_warps=8, num_stages=2, min_kv_split_tokens=512),
        "m128_w8_s3": TileConfig(small_m=packed_min, small_n=128, big_m=max(128, packed_min), big_n=64,
                                 num_warps=8, num_stages=3, min_kv_split_tokens=512),
        "m64_n128_w4": TileConfig(small_m=packed_min, small_n=128, big_m=max(64, packed_min), big_n=128,
                                  num_warps=4, num_stages=2, min_kv_split_tokens=512),
        "m128_n128_w8": TileConfig(small_m=packed_min, small_n=128, big_m=max(128, packed_min), big_n=128,
                                   num_warps=8, num_stages=2, min_kv_split_tokens=512),
        "split256": replace(base, min_kv_split_tokens=256),
        # class-specialised BIG and SMALL launches (the decode steps' config, decode_tile_config)
        "split_classes": decode_tile_config(head_dim, group_size, interpret=False),
    }
