"""Per-part tile sizes of the attention kernels (BatchLLM section 5): a small hand table keyed on
shapes, for the SMALL (decode-like) and BIG (MatMul-like) tiles of one launch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from batchllm.attention_plan.checks import next_power_of_2

FP8_MMA_DTYPES = ("query", "float16")


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
    # An FP8 cache's tiles meet the query in MMAs of this dtype: "query" (converted to the query
    # dtype) or "float16" (ops/attention_kernels.py, FP8_AS_F16)
    fp8_mma_dtype: str = "query"
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

    def __post_init__(self) -> None:
        if self.fp8_mma_dtype not in FP8_MMA_DTYPES:
            raise ValueError(f"fp8_mma_dtype must be one of {FP8_MMA_DTYPES}, got {self.fp8_mma_dtype!r}")

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
    if base.small_n < 64:  # the interpreter's tiny config (CPU tests): only the split, and the FP8 row's MMAs
        return replace(base, split_classes=True, fp8_mma_dtype="float16" if kv_fp8 else "query")
    bf16 = replace(base, split_classes=True, small_n=64, small_num_warps=4, small_num_stages=2)
    if not kv_fp8:
        return bf16
    # FP8 cache: SMALL steps of 128 positions move the bytes of the bf16 row's 64 (as do split-KV
    # pieces of at least 1024 positions). float16 MMAs: sm_90 converts two e4m3 values to float16
    # in one instruction, to bfloat16 in three, and at 16 conversions a clock per SM the bfloat16
    # path alone allows at most about 65% of the copy rate. The register cap keeps 4 programs per
    # SM: compiled for sm_90 the SMALL variant took 149 registers (3 programs per SM), and the
    # persistent grid's 4th program per SM then ran as a second wave.
    return replace(bf16, small_n=128, min_kv_split_tokens=1024, small_max_registers=128, fp8_mma_dtype="float16")


def decode_tile_candidates(head_dim: int, group_size: int, kv_fp8: bool) -> dict[str, TileConfig]:
    """The decode tiles that benchmarks/attention.py --scenarios decode_sweep times on the GPU: the
    table's row for the cache ("table") and variations of it, each a value of TileConfig fields.
    FP8: the bf16 row (what an FP8 cache ran before its own row), with the register cap; float16
    MMAs at 64 positions a step; then the FP8 row with 3 or 5 stages (5 double-buffers K and V:
    the block-table load takes a stage of its own), 8 warps, 256 positions a step."""
    table = decode_tile_config(head_dim, group_size, interpret=False, kv_fp8=kv_fp8)
    if not kv_fp8:
        return {"table": table, "s3": replace(table, small_num_stages=3),
                "s5": replace(table, small_num_stages=5, graph_programs_per_sm=3),
                "n128": replace(table, small_n=128, small_max_registers=168, graph_programs_per_sm=3)}
    bf16_row = decode_tile_config(head_dim, group_size, interpret=False)
    f16_n64 = replace(bf16_row, small_max_registers=128, fp8_mma_dtype="float16")
    return {"bf16_row": bf16_row, "bf16_row_r128": replace(bf16_row, small_max_registers=128),
            "query_n128": replace(table, fp8_mma_dtype="query"), "f16_n64": f16_n64,
            "f16_n64_s5": replace(f16_n64, small_num_stages=5),
            "f16_n64_p6": replace(f16_n64, small_max_registers=80, graph_programs_per_sm=6),
            "table": table, "n128_s3": replace(table, small_num_stages=3),
            "n128_s5": replace(table, small_num_stages=5, small_max_registers=168, graph_programs_per_sm=3),
            "n128_w8": replace(table, small_num_warps=8, graph_programs_per_sm=2),
            "n256": replace(table, small_n=256, graph_programs_per_sm=2)}
