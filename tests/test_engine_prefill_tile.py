"""Steps with prefill chunks may use their own attention tile config; decode-only steps (the
CUDA-graph steps) use decode_tile_config (class-split launches); the bench's +ptile suffix."""

import pytest
import torch

from batchllm.bench.policies import parse_policy
from batchllm.engine.attention import FusedPrefixBackend, TritonPagedBackend
from batchllm.engine.step_inputs import build_step_inputs
from batchllm.ops.tile_config import (
    decode_tile_config,
    default_tile_config,
    prefill_tile_candidates,
)
from batchllm.sched.interface import ScheduledChunk, SchedulerOutput


def _step(prefill: bool) -> SchedulerOutput:
    chunks = [ScheduledChunk(seq_id=0, token_ids=(5,), start_position=20, new_block_ids=(0, 1), sample=True,
                             is_decode=True)]
    if prefill:
        chunks.append(ScheduledChunk(seq_id=1, token_ids=tuple(range(30)), start_position=0, new_block_ids=(2, 3),
                                     sample=True))
    return SchedulerOutput(0, tuple(chunks))


@pytest.mark.parametrize("backend_cls", [FusedPrefixBackend, TritonPagedBackend])
def test_prefill_steps_use_the_prefill_tile(backend_cls):
    backend = backend_cls(16, 8, 2, 64, torch.device("cpu"))
    candidates = prefill_tile_candidates(64, 4)
    default = default_tile_config(64, 4)
    assert backend.build_host_plan(build_step_inputs(_step(True), 16)).tile == default  # not set: default
    backend.prefill_tile = candidates["m128_w8"]
    assert backend.build_host_plan(build_step_inputs(_step(True), 16)).tile == candidates["m128_w8"]
    decode = backend.build_host_plan(build_step_inputs(_step(False), 16)).tile
    assert decode == decode_tile_config(64, 4) and decode.split_classes


def test_candidates_and_policy_suffix():
    candidates = prefill_tile_candidates(128, 4)
    assert candidates["default"] == default_tile_config(128, 4, interpret=False)
    assert all(c.big_m >= 16 and c.small_m >= 16 and c.big_n >= 16 for c in candidates.values())
    spec = parse_policy("batchllm@4096+ptile+sync")
    assert spec.name == "batchllm" and spec.flags == {"ptile", "sync"}
    assert spec.changes == {"policy": "batchllm", "max_num_batched_tokens": 4096}


def test_decode_tile_policy_suffix():
    spec = parse_policy("batchllm+dtile")
    assert spec.name == "batchllm" and spec.flags == {"dtile"}
    assert "split_classes" in prefill_tile_candidates(128, 4) and "default" in prefill_tile_candidates(128, 4)
    assert prefill_tile_candidates(128, 4)["split_classes"] == decode_tile_config(128, 4, interpret=False)


def test_bad_tile_name_leaves_the_backend_untouched():
    """Regression: with +ptile+dtile, a bad --decode-tile used to raise after the prefill tile
    was already set on the backend, so every later policy of the bench ran with it."""
    from types import SimpleNamespace

    from batchllm.bench.runner import run_policy

    backend = TritonPagedBackend(16, 8, 2, 64, torch.device("cpu"))
    decode_before = backend.decode_tile
    engine = SimpleNamespace(runner=SimpleNamespace(graphs=None, backend=backend), async_scheduling=True,
                             arch=SimpleNamespace(head_dim=64, num_heads=8, num_kv_heads=2),
                             configure_scheduler=lambda **changes: None, scheduler_config=None)
    llm = SimpleNamespace(engine=engine)
    case = SimpleNamespace(prompts=[[1, 2, 3]])
    with pytest.raises(ValueError, match="--decode-tile must be one of"):
        run_policy(llm, case, parse_policy("vllm+ptile+dtile"), None, None, 1.0, "m", None,
                   prefill_tile="m128_w8", decode_tile="no_such_tile")
    assert backend.prefill_tile is None and backend.decode_tile == decode_before
