"""Steps with prefill chunks run prefill_tile_config; decode-only steps (the CUDA-graph steps)
decode_tile_config (class-split launches); the split-KV target is the device's SM count."""

from dataclasses import replace

import pytest
import torch

from batchllm.attention_plan.tile_config import TileConfig, decode_tile_config, default_tile_config, prefill_tile_config
from batchllm.engine.attention.triton_backend import TritonBackend
from batchllm.engine.step_inputs import build_step_inputs
from batchllm.sched.interface import ScheduledChunk, SchedulerOutput


def _step(prefill: bool) -> SchedulerOutput:
    chunks = [ScheduledChunk(seq_id=0, token_ids=(), start_position=20, num_tokens=1, new_block_ids=(0, 1),
                             sample=True, is_decode=True)]
    if prefill:
        chunks.append(ScheduledChunk(seq_id=1, token_ids=tuple(range(30)), start_position=0, num_tokens=30,
                                     new_block_ids=(2, 3), sample=True))
    return SchedulerOutput(0, tuple(chunks))


@pytest.mark.parametrize("uses_groups", [True, False])  # fused, triton
def test_prefill_and_decode_steps_get_their_tiles(uses_groups):
    backend = TritonBackend(16, 8, 2, 64, torch.device("cpu"), uses_groups)
    prefill = backend.build_plan(build_step_inputs(_step(True), 16)).tile
    assert prefill == prefill_tile_config(64, 4)
    decode = backend.build_plan(build_step_inputs(_step(False), 16)).tile
    assert decode.split_classes and not default_tile_config(64, 4).split_classes
    assert decode == decode_tile_config(64, 4)


def test_decode_tiles_on_the_gpu_table():
    """The GPU decode config: the default table's tiles, class-split, SMALL tiles streaming KV in
    steps of 64 with 4 warps and 2 stages, no dense calls (values written out, not read back from
    the table)."""
    decode = decode_tile_config(128, 4, interpret=False)
    assert decode == TileConfig(small_m=16, small_n=64, big_m=64, big_n=64, num_warps=4, num_stages=2,
                                min_kv_split_tokens=512, split_classes=True, small_num_warps=4, small_num_stages=2,
                                dense_min_rows=0, dense_min_tokens=1024)


def test_prefill_table_on_the_gpu_makes_dense_calls_from_512_rows():
    """Unmasked calls from 512 rows x 1024 positions; causal squares from 4096 rows."""
    prefill = default_tile_config(128, 4, interpret=False)
    assert (prefill.dense_min_rows, prefill.dense_min_tokens) == (512, 1024) and not prefill.split_classes
    assert prefill.causal_square_rows() == 4096
    assert replace(prefill, dense_min_rows=0).causal_square_rows() == 0  # one switch turns every call off
    assert default_tile_config(128, 4, interpret=True).dense_min_rows == 0  # the interpreter: tiles only


def test_windowed_models_plan_without_dense_calls(monkeypatch):
    """Dense calls have no sliding-window path: a backend for a model with any windowed layer
    plans its prefill steps with dense_min_rows 0 (on the GPU table, which has them), its tiles
    otherwise those of the prefill table."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # plan with the GPU table (no kernel runs here)
    backend = TritonBackend(16, 8, 2, 128, torch.device("cpu"), uses_groups=True)
    assert backend.build_plan(build_step_inputs(_step(True), 16)).tile.dense_min_rows == 512
    backend = TritonBackend(16, 8, 2, 128, torch.device("cpu"), uses_groups=True, layer_windows=(None, 4096))
    prefill = backend.build_plan(build_step_inputs(_step(True), 16)).tile
    assert prefill == replace(prefill_tile_config(128, 4, interpret=False), dense_min_rows=0)


def test_prefill_table_splits_the_tile_classes_of_large_heads():
    """Steps with prefill chunks on heads of 128: BIG and SMALL launches apart, the SMALL one in
    BLOCK_N 64 steps; an FP8 cache adds float16 MMAs, V converted by PTX, a 128-register cap and,
    for GQA groups of up to 4, SMALL items 4 to a program. Smaller heads keep the default table;
    the interpreter gets the split on its tiny tiles, packed on an FP8 cache."""
    bf16 = prefill_tile_config(128, 4, interpret=False)
    fp8 = prefill_tile_config(128, 4, interpret=False, kv_fp8=True)
    default = default_tile_config(128, 4, interpret=False)
    assert bf16 == replace(default, split_classes=True, small_n=64, small_num_warps=4, small_num_stages=2)
    assert fp8 == replace(bf16, small_max_registers=128, fp8_conversion="float16_ptx_v", small_pack=4)
    assert prefill_tile_config(128, 8, interpret=False, kv_fp8=True).small_pack == 1
    assert prefill_tile_config(64, 3, interpret=False, kv_fp8=True) == default_tile_config(64, 3, interpret=False)
    tiny = prefill_tile_config(32, 3, interpret=True, kv_fp8=True)
    base = default_tile_config(32, 3, interpret=True)
    assert tiny == replace(base, split_classes=True, fp8_conversion="float16_ptx_v", small_pack=4,
                           small_n=4 * base.small_n)


def test_cpu_backend_sizes_split_kv_for_its_stand_in_sm_count():
    backend = TritonBackend(16, 8, 2, 64, torch.device("cpu"), uses_groups=True)
    assert backend.num_sms == 8  # device_num_sms's CPU stand-in (no GPU to ask)
