"""The scheduler counts outputs; their ids arrive once, in the caller's list, when read. Driven as
the engine's step loop drives it at depth 1 (step N's ids read after step N+1 is scheduled), every
policy makes exactly the steps it makes at depth 0, under preemption and recompute: decode rows
carry no ids, and a chunk never asks for an id that has not been read."""

from __future__ import annotations

import pytest

from batchllm.perf.schedule_digest import workload_requests
from batchllm.sched.config import SchedulerConfig
from batchllm.sched.factory import make_scheduler
from batchllm.sched.interface import SchedRequest, SchedulerOutput
from batchllm.sched.seq_state import SeqState
from batchllm.sched.simulator import fake_token

POLICIES = ("batchllm", "vllm", "sglang", "simple")


def _requests() -> list[SchedRequest]:
    """micro 2000/200 sd16 with 51 requests of 100 tokens (the pinned digests' workload)."""
    return [SchedRequest(i, list(r.prompt_token_ids), r.max_tokens)
            for i, r in enumerate(workload_requests("micro:2000:200:16#1024", scale=0.05))]


def _drive(policy: str, depth: int, stop_mod: int | None = None) -> tuple[list[SchedulerOutput], dict]:
    """The step loop's order: schedule step N -> read every step but the newest `depth` -> update N.
    stop_mod: a token divisible by it ends its request ("stop"), known once read."""
    # 20,000 KV tokens: every policy preempts (batchllm with its reservation off)
    config = SchedulerConfig(policy=policy, num_kv_blocks=1250, block_size=16, max_num_batched_tokens=2048,
                             decode_reserve_ratio=0.0)
    scheduler = make_scheduler(config)
    requests = _requests()
    by_id = {r.request_id: r for r in requests}
    scheduler.add_requests(requests)
    stopped: set[int] = set()
    outputs, unread = [], []
    while scheduler.has_unfinished() or unread:
        launched = None
        if scheduler.has_unfinished():
            launched = scheduler.schedule()
            outputs.append(launched)
            unread.append(launched)
        while len(unread) > (depth if launched is not None else 0):
            for chunk in unread.pop(0).chunks:  # read: append each sampled id once
                request = by_id.get(chunk.seq_id)
                if chunk.sample and chunk.seq_id not in stopped:
                    token = fake_token(chunk.seq_id, len(request.output_token_ids))
                    request.output_token_ids.append(token)
                    if stop_mod and token % stop_mod == 0:
                        stopped.add(chunk.seq_id)
        if launched is None:
            break
        reasons = {}
        for chunk in launched.chunks:
            if chunk.is_prefix:
                continue
            request = by_id[chunk.seq_id]
            if chunk.seq_id in stopped:
                reasons[chunk.seq_id] = "stop"
            elif chunk.sample and chunk.kv_len - request.num_prompt_tokens + 1 >= request.max_tokens:
                reasons[chunk.seq_id] = "length"
        scheduler.update(launched, reasons)
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks
    return outputs, {r.request_id: r.output_token_ids for r in requests}


@pytest.mark.parametrize("policy", POLICIES)
def test_unread_outputs_schedule_as_read_ones(policy):
    sync, sync_outputs = _drive(policy, 0)
    asynchronous, async_outputs = _drive(policy, 1)
    assert asynchronous == sync  # every chunk, its ids included, and every dropped id
    assert async_outputs == sync_outputs
    assert sum(len(o.preempted_request_ids) for o in sync) > 0
    decode = [c for o in sync for c in o.chunks if c.is_decode]
    assert decode and all(c.token_ids == () for c in decode[:10])
    requests = _requests()
    recomputed = [c for o in sync for c in o.chunks if not c.is_prefix and c.token_ids
                  and c.kv_len > requests[c.seq_id].num_prompt_tokens]
    assert recomputed  # prompt chunks that carry generated ids: recompute after a preemption
    for chunk in recomputed:
        logical = requests[chunk.seq_id].prompt_token_ids + list(sync_outputs[chunk.seq_id])
        assert chunk.token_ids == tuple(logical[chunk.start_position:chunk.kv_len])


@pytest.mark.parametrize("policy", POLICIES)
def test_early_stops_read_a_step_late_never_ask_for_unread_ids(policy):
    """A stop is known one step late at depth 1 (its request runs one more row, then finishes):
    the outputs as far as each stop are those of depth 0."""
    sync = _drive(policy, 0, stop_mod=50)[1]
    asynchronous = _drive(policy, 1, stop_mod=50)[1]
    assert asynchronous == sync
    assert any(len(ids) < r.max_tokens for r, ids in zip(_requests(), sync.values()))


def test_an_id_not_read_is_never_an_input():
    seq = SeqState(SchedRequest(0, [1, 2, 3], 4))
    seq.chunk(3)  # the prompt, sampling output 0 (in flight)
    assert (seq.num_outputs, seq.num_pending_tokens) == (1, 1)
    assert seq.chunk(1).token_ids == ()  # a decode row: fed on the device
    seq.drop_blocks()  # preempted: a recompute needs output 0's id, not read yet
    with pytest.raises(AssertionError, match="before its id was read"):
        seq.chunk(5)
    seq.request.output_token_ids.extend([40, 41])
    assert seq.chunk(5).token_ids == (1, 2, 3, 40, 41)
    # Resumed on cached KV up to its newest token (a prefix-cache hit): that one token is a decode
    # row, but no chunk of this row sampled it, so it carries its id.
    seq.request.output_token_ids.append(42)
    seq.drop_blocks()
    seq.num_computed_tokens = 5
    chunk = seq.chunk(1)
    assert (chunk.is_decode, chunk.token_ids, chunk.sample) == (True, (42,), True)
    assert seq.chunk(1).token_ids == ()  # the next one is fed on the device
