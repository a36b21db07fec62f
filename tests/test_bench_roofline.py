"""The roofline of a run's steps: max(FLOPs / peak, bytes read / bandwidth) per step, summed; what a
step reads (weights, LM head, KV with a group's prefix once) and the schedule replay it runs on."""

import pytest

from batchllm.perf.flop_bound import H200_BF16_PEAK_FLOPS, work_flops
from batchllm.perf.roofline import (H200_COPY_BANDWIDTH_BYTES_PER_S, StepWork, TrafficModel, roofline,
                                     step_byte_parts, step_bytes_read, step_flop_parts, step_flops, step_work)
from batchllm.perf.schedule_replay import replay_schedule
from batchllm.sched.config import SchedulerConfig
from batchllm.sched.interface import ScheduledChunk, ScheduledChunks
from batchllm.perf.workloads import micro_workload

NUM_PARAMS = 7_000_000_000  # non-embedding parameters of an 8B-like model


class _Arch8B:
    num_layers, num_heads, num_kv_heads, head_dim, vocab_size, hidden_size = 32, 32, 8, 128, 128256, 4096

    @staticmethod
    def num_params(include_embeddings: bool) -> int:
        assert not include_embeddings
        return NUM_PARAMS


KV_BYTES = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
BF16 = TrafficModel(weight_bytes_per_element=2, lm_head_bytes_per_element=2, kv_bytes_per_token=KV_BYTES)
ATTENTION = 4.0 * 32 * 32 * 128  # FLOPs per (row, key)
LM_HEAD = 128256 * 4096  # elements


def test_decode_step_is_bytes_bound():
    # 64 requests decoding at position 2200 (2201 keys each): every weight, the LM head, 64 x 2201 KV
    step = StepWork(num_tokens=64, num_attended_keys=64 * 2201, num_sampled_rows=64, num_kv_tokens_read=64 * 2201)
    flops = 2.0 * NUM_PARAMS * 64 + ATTENTION * 64 * 2201 + 2.0 * LM_HEAD * 64
    read = 2.0 * NUM_PARAMS + 2.0 * LM_HEAD + 64 * 2201 * KV_BYTES
    assert step_flops(_Arch8B, step) == flops
    assert step_bytes_read(_Arch8B, BF16, step) == read
    bound = roofline(_Arch8B, [step], BF16)
    assert bound.seconds == read / H200_COPY_BANDWIDTH_BYTES_PER_S  # 8.7 ms of reads against 1.6 ms of math
    assert read / H200_COPY_BANDWIDTH_BYTES_PER_S > 5 * flops / H200_BF16_PEAK_FLOPS
    assert bound.num_memory_bound_steps == 1


def test_prefill_step_of_2048_tokens_is_flop_bound():
    # one request's first 2048 prompt tokens at positions 0..2047 (causal), its last row sampled
    step = step_work([ScheduledChunk(seq_id=0, token_ids=tuple(range(2048)), start_position=0, num_tokens=2048,
                                     new_block_ids=(), sample=True)])
    assert step == StepWork(2048, 2048 * 2049 // 2, 1, 2048)
    flops = 2.0 * NUM_PARAMS * 2048 + ATTENTION * (2048 * 2049 // 2) + 2.0 * LM_HEAD
    read = 2.0 * NUM_PARAMS + 2.0 * LM_HEAD + 2048 * KV_BYTES
    bound = roofline(_Arch8B, [step], BF16)
    assert bound.seconds == flops / H200_BF16_PEAK_FLOPS  # 39 ms of math against 3.7 ms of reads
    assert flops / H200_BF16_PEAK_FLOPS > 5 * read / H200_COPY_BANDWIDTH_BYTES_PER_S
    assert bound.num_memory_bound_steps == 0
    # without a sampled row the LM head is neither computed nor read
    unsampled = StepWork(2048, 2048 * 2049 // 2, 0, 2048)
    assert step_bytes_read(_Arch8B, BF16, unsampled) == read - 2.0 * LM_HEAD


def test_steps_add_up_and_fp8_weights_read_one_byte():
    decode = StepWork(64, 64 * 2201, 64, 64 * 2201)
    prefill = StepWork(2048, 2048 * 2049 // 2, 1, 2048)
    both = roofline(_Arch8B, [prefill, decode], BF16)
    assert both.seconds == roofline(_Arch8B, [prefill], BF16).seconds + roofline(_Arch8B, [decode], BF16).seconds
    assert both.num_memory_bound_steps == 1
    fp8 = TrafficModel(weight_bytes_per_element=1, lm_head_bytes_per_element=2, kv_bytes_per_token=KV_BYTES // 2)
    assert step_bytes_read(_Arch8B, fp8, decode) == 1.0 * NUM_PARAMS + 2.0 * LM_HEAD + 64 * 2201 * KV_BYTES // 2
    assert roofline(_Arch8B, [decode], fp8, peak_flops=1e15, bandwidth_bytes_per_s=1e12).seconds == \
        step_bytes_read(_Arch8B, fp8, decode) / 1e12
    with pytest.raises(ValueError, match="positive"):
        roofline(_Arch8B, [decode], BF16, bandwidth_bytes_per_s=0)


def test_serial_roofline_charges_a_mixed_steps_kv_reads_beside_its_gemms():
    # 1792 prompt rows at positions 0..1791 (causal) and 256 decode rows at position 2400: the
    # GEMMs of 2048 rows are bound by arithmetic, the decode rows' 256 x 2401 KV positions by
    # reading them, and the plain roofline lets the GEMMs' time hide those reads
    prompt_keys = 1792 * 1793 // 2
    step = StepWork(num_tokens=2048, num_attended_keys=prompt_keys + 256 * 2401, num_sampled_rows=257,
                    num_kv_tokens_read=1792 + 256 * 2401)
    linear_flops, attention_flops = step_flop_parts(_Arch8B, step)
    assert linear_flops == 2.0 * NUM_PARAMS * 2048 + 2.0 * LM_HEAD * 257
    assert attention_flops == ATTENTION * (prompt_keys + 256 * 2401)
    weights, kv = step_byte_parts(_Arch8B, BF16, step)
    assert (weights, kv) == (2.0 * NUM_PARAMS + 2.0 * LM_HEAD, (1792 + 256 * 2401) * KV_BYTES)
    peak, bandwidth = H200_BF16_PEAK_FLOPS, H200_COPY_BANDWIDTH_BYTES_PER_S
    bound = roofline(_Arch8B, [step], BF16)
    assert bound.seconds == (linear_flops + attention_flops) / peak  # 38 ms of math against 23 ms of reads
    # the linear part is math (37 ms against 4 ms of weights), attention reads (19 ms of KV against 1.5 ms of math)
    assert bound.serial_seconds == pytest.approx(linear_flops / peak + kv / bandwidth)
    assert bound.serial_seconds > 1.4 * bound.seconds
    # a decode step reads both parts' bytes: the serial roofline is the plain one
    decode = StepWork(64, 64 * 2201, 64, 64 * 2201)
    both = roofline(_Arch8B, [decode], BF16)
    assert both.serial_seconds == pytest.approx(both.seconds)
    assert roofline(_Arch8B, [step, decode], BF16).serial_seconds == pytest.approx(bound.serial_seconds
                                                                                     + both.serial_seconds)


def _chunk(seq_id, start, count, *, shared=0, group=-1, prefix=False, sample=False, decode=False):
    return ScheduledChunk(seq_id=seq_id, token_ids=() if decode else (7,) * count, start_position=start,
                          num_tokens=count, new_block_ids=(),
                          shared_kv_len=shared, is_prefix=prefix, sample=sample, group_id=group, is_decode=decode)


def test_a_groups_prefix_is_read_once_per_step():
    # group 0: its last 100 prefix tokens (positions 900..999) and a member's 20 distinct tokens
    # after the 1000-token prefix; group 1: two members decoding after a 500-token prefix;
    # an ungrouped request (the per-request policies) decoding at position 1500, 300 of its
    # positions in shared (cached) blocks: it reads all 1501 itself.
    chunks = [_chunk(-1, 900, 100, group=0, prefix=True),
              _chunk(3, 1000, 20, shared=1000, group=0, sample=True),
              _chunk(4, 530, 1, shared=500, group=1, sample=True, decode=True),
              _chunk(5, 540, 1, shared=500, group=1, sample=True, decode=True),
              _chunk(6, 1500, 1, shared=300, sample=True, decode=True)]
    work = step_work(chunks)
    assert step_work(ScheduledChunks.from_chunks(chunks)) == work  # the columns' sums are the loop's
    assert work.num_tokens == 100 + 20 + 1 + 1 + 1
    assert work.num_sampled_rows == 4
    assert work.num_attended_keys == (100 * 900 + 100 * 101 // 2) + (20 * 1000 + 20 * 21 // 2) + 531 + 541 + 1501
    assert work.num_kv_tokens_read == 1000 + 20 + 500 + 31 + 41 + 1501


def test_replayed_batchllm_schedule_does_the_optimal_work():
    """Over the batchllm policy's replayed steps the FLOPs add up to work_flops (every prefix once),
    and the prefix KV is read once per group per step."""
    workload = micro_workload(64, 8, 4, num_requests=16, output_num_tokens=5, vocab_size=32000, seed=0)
    prompts = [p.tolist() for p in workload.prompts]
    config = SchedulerConfig(policy="batchllm", num_kv_blocks=256, block_size=16, max_num_batched_tokens=256)
    replay = replay_schedule(prompts, workload.max_tokens, config)
    from batchllm.prefix.planner import plan_prefix_groups

    plan = plan_prefix_groups(prompts)
    groups = [(len(g.prefix_token_ids), [len(d) for d in g.distinct_token_ids], g.request_indices)
              for g in plan.groups]
    assert sum(step_flops(_Arch8B, step) for step in replay.steps) == work_flops(_Arch8B, groups, workload.max_tokens)
    assert sum(step.num_sampled_rows for step in replay.steps) == 16 * 5
    vllm = replay_schedule(prompts, workload.max_tokens, SchedulerConfig(policy="vllm", num_kv_blocks=256,
                                                                         max_num_batched_tokens=256))
    # a step of 16 decode rows attends each row's whole KV: vllm reads it all, batchllm each of the
    # 4 groups' 64-token prefixes once instead of 4 times
    for schedule, prefix_reads_saved in ((replay, 12 * 64), (vllm, 0)):
        decode_steps = [step for step, counts in zip(schedule.steps, schedule.counts) if counts[:3] == (16, 0, 0)]
        assert decode_steps
        for step in decode_steps:
            assert step.num_kv_tokens_read == step.num_attended_keys - prefix_reads_saved


def test_replay_matches_a_run_with_the_same_steps():
    workload = micro_workload(32, 8, 2, num_requests=4, output_num_tokens=3, vocab_size=32000, seed=0)
    prompts = [p.tolist() for p in workload.prompts]
    config = SchedulerConfig(policy="vllm", num_kv_blocks=64, max_num_batched_tokens=64)
    replay = replay_schedule(prompts, workload.max_tokens, config)

    class Record:
        def __init__(self, counts):
            self.num_decode_tokens, self.num_distinct_tokens, self.num_prefix_tokens, self.num_used_blocks = counts

    records = [Record(counts) for counts in replay.counts]
    assert replay.matches(records) and not replay.matches(records[:-1])
    assert len(replay.steps) == len(replay.counts) >= 3
