"""Per-part tile sizes of the attention kernels (BatchLLM section 5): a small hand table keyed on
shapes, for the SMALL (decode-like) and BIG (MatMul-like) tiles of one launch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from batchllm.attention_plan.checks import next_power_of_2

FP8_CONVERSIONS = ("query", "float16", "float16_ptx_v")


@dataclass(frozen=True)
class TileConfig:
    small_m: int  # packed (token x GQA head) rows of a small tile
    small_n: int  # KV positions per inner step of a small tile
    big_m: int
    big_n: int
    num_warps: int
    num_stages: int
    min_kv_split_tokens: int  # never split a KV range into pieces shorter than this
    # Persistent launches in CUDA graphs (docs/design.md): this many programs per SM stride over
    # the step's items (a grid of the graph's padded capacity ran 12,288 programs for 960 real
    # ones on a tail decode step of micro 2000/200 sd16)
    graph_programs_per_sm: int = 4
    # BIG and SMALL items as two launches of class-specialised kernel variants (CLASSES 2, then
    # 1), the SMALL one with its own warps / stages (None: num_warps / num_stages)
    split_classes: bool = False
    small_num_warps: int | None = None
    small_num_stages: int | None = None
    # Registers per thread of the SMALL launch (ptxas's maxnreg; None: the compiler's choice): a
    # persistent grid of graph_programs_per_sm programs runs in one wave only if they all fit on
    # an SM at once (65536 registers: 128 each for 4 programs of 4 warps)
    small_max_registers: int | None = None
    # With split_classes: the SMALL launch's items are one row each (segments of several rows get
    # BIG tiles), this many to a program, each KV step reading small_n // small_pack positions of
    # every one under a block-diagonal mask (ops/attention_kernels.py, _attend_packed); 1: one item
    # a program, of up to small_m // group rows
    small_pack: int = 1
    # ... but SMALL items over this many KV positions still run one to a program (first in the
    # list): packed, a step's few long items lose parallelism and gain no overlap
    small_pack_max_positions: int = 512
    # How an FP8 cache's tiles reach the MMAs (ops/attention_kernels.py): "query", converted to the
    # query dtype; "float16", to float16 (FP8_AS_F16), by Triton's conversion, which Triton moves
    # after the tile's shared-memory load in the MMA operand layout (single-byte loads for V);
    # "float16_ptx_v", to float16, K by Triton's conversion and V by one PTX instruction per two
    # values right after its load (FP8_PTX, on a GPU), so that V's operand comes from float16 in
    # shared memory through ldmatrix
    fp8_conversion: str = "query"
    # A segment of at least this many query rows runs the KV range that all its rows see whole
    # (a group's prefix for its members, the context before a prefill chunk) as one dense
    # attention call on a library kernel (cuDNN) over its gathered blocks, when that range holds
    # at least dense_min_tokens positions (dense_calls.py); 0: never.
    dense_min_rows: int = 0
    dense_min_tokens: int = 256
    # A prefill chunk of at least dense_min_rows rows also runs the causal square of its own
    # positions as a dense call with the library's causal mask, when that call has at least this
    # many rows: equal squares on consecutive rows run as one call with a batch dimension, so
    # they count together. A group's prefix chunk with a call leaves its group's segment for it
    # (dense_calls.py).
    dense_causal_min_rows: int = 0
    # The dense calls' kernel takes any lengths (ops/fa3_dense.py): each call keeps the whole KV
    # range its rows see, rather than one cut down to the library kernel's grid of sizes
    # (dense_calls.dense_size_step), whose rest the work list runs.
    dense_any_size: bool = False
    # A chunk's causal call also holds the context before it, under a bottom-right mask (a kernel
    # that has one: ops/fa3_dense.py), so that its rows have no other part to merge.
    dense_causal_whole: bool = False

    def __post_init__(self) -> None:
        if self.fp8_conversion not in FP8_CONVERSIONS:
            raise ValueError(f"fp8_conversion must be one of {FP8_CONVERSIONS}, got {self.fp8_conversion!r}")
        if self.small_pack > 1 and (not self.split_classes or self.small_pack & (self.small_pack - 1)
                                    or self.small_n % self.small_pack):
            raise ValueError(f"small_pack must be a power of 2 that divides small_n ({self.small_n}), with "
                             f"split_classes; got {self.small_pack}")

    def causal_square_rows(self) -> int:
        """Least rows of a causal dense call (all its squares together); 0: none."""
        return max(self.dense_min_rows, self.dense_causal_min_rows) if self.dense_min_rows > 0 else 0

    @property
    def kv_split_multiple(self) -> int:
        return max(self.small_n, self.big_n)


def default_tile_config(head_dim: int, group_size: int, interpret: bool | None = None) -> TileConfig:
    """Hand-tuned table; the interpreter (CPU tests) always gets one small config."""
    if interpret is None:
        interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    packed_min = max(16, next_power_of_2(group_size))
    if interpret:
        return TileConfig(small_m=packed_min, small_n=16, big_m=max(32, packed_min), big_n=16,
                          num_warps=4, num_stages=1, min_kv_split_tokens=16)
    if head_dim <= 64:
        return TileConfig(small_m=packed_min, small_n=64, big_m=max(64, packed_min), big_n=64,
                          num_warps=4, num_stages=3, min_kv_split_tokens=256)
    # H200, Llama-3.1-8B heads, bf16, tuned on the settings of benchmarks/attention.py: no other
    # tile size, warp or stage count tried was faster on all of them; bigger BIG tiles run dense
    # causal attention faster but made the engine's mixed steps slower. Dense calls (cuDNN through
    # PyTorch) from 512 rows x 1024 fully visible KV positions, causal calls from 4096 rows: below
    # that a call's host cost (about six launches, 100-120 us for a cuDNN call) exceeds the GPU
    # time it saves (docs/design.md, "Dense calls").
    return TileConfig(small_m=packed_min, small_n=128, big_m=max(64, packed_min), big_n=64,
                      num_warps=4, num_stages=2, min_kv_split_tokens=512, dense_min_rows=512,
                      dense_min_tokens=1024, dense_causal_min_rows=4096)


def decode_tile_config(head_dim: int, group_size: int, interpret: bool | None = None,
                       kv_fp8: bool = False) -> TileConfig:
    """Tiles of decode-only steps (the engine's CUDA-graph steps): the default table with the BIG
    and SMALL items in two class-specialised launches, the SMALL one streaming KV in BLOCK_N 64
    steps. Made persistent for graphs, the fused kernel spills (255 registers + stack on sm_90);
    the class-specialised variants do not. Steps with prefill chunks (eager) keep the fused launch
    (default_tile_config), whose interleaved work order already shares the SMs between classes.
    kv_fp8: the row of a float8_e4m3fn cache (one byte a value), below."""
    # no dense calls in graphs
    base = replace(default_tile_config(head_dim, group_size, interpret), dense_min_rows=0, dense_causal_min_rows=0)
    if base.small_n < 64:  # the interpreter's tiny config (CPU tests): only the split, and the FP8 row's MMAs and packing
        if not kv_fp8:
            return replace(base, split_classes=True)
        pack = _small_pack(base, group_size)
        return replace(base, split_classes=True, fp8_conversion="float16_ptx_v", small_pack=pack,
                       small_n=pack * base.small_n)
    bf16 = replace(base, split_classes=True, small_n=64, small_num_warps=4, small_num_stages=2)
    if not kv_fp8:
        return bf16
    # FP8 cache, compiled for sm_90 with Triton 3.7 (the bf16 row's SMALL loop: 404 instructions a
    # warp per 32 KiB step). The bf16 row on an FP8 cache ran 917 per 16 KiB step, 192 of them
    # conversions (e4m3 to bfloat16 takes three instructions per two values, to float16 one), and
    # 149 registers: 3 programs per SM, so the persistent grid's 4th ran as a second wave. This
    # row: float16 MMAs, V converted by PTX where its tile is loaded and K by Triton (whose load
    # Triton then pipelines), SMALL steps of 128 positions and split-KV pieces of at least 1024 (the
    # bytes of the bf16 row's 64 and 512), 3 stages, and 3 programs per SM of 168 registers. On the
    # H200, 600 decode rows over about 1,200 positions: 0.525 ms a layer (2.84 TB/s), against 0.673
    # with both tiles converted by PTX and 2 stages; 1,700 rows over about 1,000: 1.226 against 1.557.
    # BIG tiles (a group's prefix for its members) also step 128 positions (the bytes of the bf16
    # row's 64) over 3 stages: micro 2000/200 sd16's decode step (64 groups of 16 members over a
    # 2000-token prefix) 0.419 ms a layer against 0.464 with 64 and 2; no BIG items in plain decode.
    fp8 = replace(bf16, small_n=128, min_kv_split_tokens=1024, small_max_registers=168, graph_programs_per_sm=3,
                  small_num_stages=3, fp8_conversion="float16_ptx_v", big_n=128, num_stages=3)
    if head_dim < 128 or _small_pack(fp8, group_size) == 1:
        return fp8
    # SMALL items of up to 512 positions 4 to a program (32 positions of each a step), 2 stages, 128
    # registers (3 programs an SM: shared memory holds no 4th): on the H200, micro 2000/200 sd16's
    # decode step (rows' own ranges of 200-280 positions) 0.360 ms a layer against 0.422, plain decode
    # steps of 600 rows x 1,200 positions and 1,700 x 1,000 (their items one to a program) 0.537 and
    # 1.228 against 0.547 and 1.246; the SMALL launch alone on the shared step 0.217 against 0.277.
    # 8 to a program (32 rows) ran that step in 0.400-0.451 ms and industrial-like steps 12-34% slower;
    # steps of 256 positions (4 or 8 items) 0.60-0.67.
    # On the bf16 cache the same packing gained at most 1% on the shared step and lost 2-4% on the
    # plain ones.
    return replace(fp8, small_pack=4, small_num_stages=2, small_max_registers=128)


def prefill_tile_config(head_dim: int, group_size: int, interpret: bool | None = None,
                        kv_fp8: bool = False) -> TileConfig:
    """Tiles of steps with prefill chunks (eager launches): the default table with the BIG items
    (prefill and prefix tiles) and the SMALL ones (decode rows) in two class-specialised launches on
    two streams, the SMALL one streaming KV in BLOCK_N 64 steps; an FP8 cache's tiles on float16
    MMAs with V converted where loaded, the SMALL launch capped at 128 registers. On the H200
    (Llama-3.1-8B heads, one layer, FP8 cache), against the fused launch with the query dtype's
    conversion: a 128/128 step of 7,100 decode rows and 34 fresh prompts 1.33 ms against 2.74, a
    2048/128 step of 800 decode rows and 7 prompts 1.77 against 2.63, 640 decode rows over 40 shared
    2000-token prefixes with a 2048-token prefix chunk 0.334 against 0.483; on a bf16 cache 1.49
    against 1.95, 2.12-2.15 against 2.13 and 0.330 against 0.364. Only heads of 128 were measured;
    smaller ones keep the default table."""
    base = default_tile_config(head_dim, group_size, interpret)
    tiny = base.small_n < 64  # the interpreter's config (CPU tests): only the split, and the FP8 MMAs
    if head_dim < 128 and not tiny:
        return base
    # the decode steps' bf16 row (its launches and SMALL tiles), with the default table's dense calls
    split = replace(decode_tile_config(head_dim, group_size, interpret), dense_min_rows=base.dense_min_rows,
                    dense_causal_min_rows=base.dense_causal_min_rows)
    if not kv_fp8:
        return split
    # SMALL items 4 to a program when none is long (ops/prefix_attention.py, small_pack): on the H200
    # the 128/128 step 1.14 ms against 1.33, the shared-prefix step 0.339 against 0.341; the 2048/128
    # step's long decode rows keep the plain kernel. On the bf16 cache packing lost 18-19% on 128/128.
    pack = _small_pack(split, group_size)
    return replace(split, small_max_registers=None if tiny else 128, fp8_conversion="float16_ptx_v", small_pack=pack,
                   small_n=pack * split.small_n if tiny else split.small_n)


def _small_pack(tile: TileConfig, group_size: int) -> int:
    """SMALL items to a program where a SMALL tile's rows hold 4 items' query heads (GQA groups of up
    to 4 in 16 rows, as Llama-3.1-8B's), else 1: larger groups were not measured."""
    return 4 if tile.small_m // group_size >= 4 else 1
