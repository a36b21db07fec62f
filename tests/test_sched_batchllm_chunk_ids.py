"""The batchllm policy's prompt chunks carry the request's own ids at their positions (prompt, then
the outputs read), recomputes after preemption included: the pinned schedule digests do not hash
token ids."""

from __future__ import annotations

import random

import numpy as np

from batchllm.sched.config import SchedulerConfig
from batchllm.sched.factory import make_scheduler
from batchllm.sched.interface import SchedRequest
from batchllm.sched.policies.batchllm_output import _prompt_heads
from batchllm.sched.simulator import fake_token


def _requests(seed: int, max_id: int = 5000) -> list[SchedRequest]:
    """Lone requests (some not sharing) mixed with groups sharing a prefix, random lengths."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, max_id) for _ in range(rng.randrange(20, 60))] for _ in range(3)]
    requests = []
    for request_id in range(120):
        kind = rng.randrange(4)
        own = [rng.randrange(1, max_id) for _ in range(rng.randrange(1, 90))]
        prompt = own if kind < 2 else prefixes[kind - 2] + own
        requests.append(SchedRequest(request_id, prompt, rng.randrange(1, 40), share_prefix=kind != 0))
    return requests


def test_chunk_ids_are_the_requests_positions_under_preemption():
    # ids past int32 (kept as int64 by the policy) in the last case
    for seed, num_kv_blocks, reserve, max_id in ((0, 4000, 1.0, 5000), (1, 60, 0.0, 5000), (2, 90, 0.0, 5000),
                                                 (3, 60, 0.0, 1 << 40)):
        requests = _requests(seed, max_id)
        by_id = {request.request_id: request for request in requests}
        config = SchedulerConfig(policy="batchllm", num_kv_blocks=num_kv_blocks, block_size=16,
                                 max_num_batched_tokens=512, decode_reserve_ratio=reserve)
        scheduler = make_scheduler(config)
        scheduler.add_requests(requests)
        num_checked = num_preempted = 0
        while scheduler.has_unfinished():
            output = scheduler.schedule()
            num_preempted += len(output.preempted_request_ids)
            reasons = {}
            for chunk in output.chunks:
                if chunk.is_prefix:
                    continue
                request = by_id[chunk.seq_id]
                if chunk.token_ids:
                    ids = request.prompt_token_ids + request.output_token_ids
                    assert list(chunk.token_ids) == ids[chunk.start_position:chunk.kv_len]
                    num_checked += 1
                if chunk.sample:
                    request.output_token_ids.append(fake_token(chunk.seq_id, len(request.output_token_ids)))
                    if len(request.output_token_ids) == request.max_tokens:
                        reasons[chunk.seq_id] = "length"
            scheduler.update(output, reasons)
        assert num_checked > len(requests)
        assert num_preempted > 0 or reserve == 1.0


def test_prompt_heads_take_whole_prompts_and_cut_the_short_ones():
    prompts = [np.arange(10 * i, 10 * i + 5, dtype=np.int32) for i in range(4)]
    heads = _prompt_heads(prompts, np.array([2, 0, 3]), np.array([5, 2, 5]), np.array([5, 5, 5]))
    assert heads.dtype == np.int64 and heads.tolist() == [20, 21, 22, 23, 24, 0, 1, 30, 31, 32, 33, 34]
    assert _prompt_heads(prompts, np.array([1]), np.array([3]), np.array([5])).tolist() == [10, 11, 12]
