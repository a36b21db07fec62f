"""The tensor-parallel step gate, with the leader and a follower in one process (the gate is
shared memory; the engine test runs it across processes)."""

import multiprocessing

import pytest

from batchllm.distributed.step_gate import RunAborted, ScheduleDivergedError, StepGate, new_shared_words, step_fingerprint
from batchllm.sched.interface import ScheduledChunk, SchedulerOutput


def _pair():
    words = new_shared_words(multiprocessing.get_context("spawn"))
    return StepGate(words, leader=True), StepGate(words, leader=False, timeout_s=5)


def test_follower_passes_the_steps_the_leader_opened():
    leader, follower = _pair()
    for fingerprint in (11, 12, 13):
        leader.pass_step(0, fingerprint)
    for fingerprint in (11, 12, 13):
        follower.pass_step(0, fingerprint)
    assert leader.next_step == follower.next_step == 3


def test_a_run_the_leader_ended_early_ends_on_the_follower_at_the_same_step():
    leader, follower = _pair()
    leader.pass_step(0, 7)
    leader.end_run(0)  # the caller stopped reading after one step
    leader.pass_step(1, 8)  # the next run has begun on the leader
    follower.pass_step(0, 7)  # the step the leader launched still runs everywhere
    with pytest.raises(RunAborted):
        follower.pass_step(0, 9)
    follower.pass_step(1, 8)  # the follower's next run starts at the leader's step
    assert follower.next_step == leader.next_step == 2


def test_a_different_schedule_is_an_error_not_wrong_tokens():
    leader, follower = _pair()
    leader.pass_step(0, 5)
    with pytest.raises(ScheduleDivergedError, match="step 0"):
        follower.pass_step(0, 6)


def test_shutdown_releases_a_waiting_follower():
    leader, follower = _pair()
    leader.stop()
    with pytest.raises(RunAborted, match="shutting down"):
        follower.pass_step(0, 1)


def test_fingerprint_tells_steps_apart():
    def output(step_index, seq_ids, num_tokens):
        chunks = tuple(ScheduledChunk(seq_id=s, token_ids=(1,) * num_tokens, start_position=0, num_tokens=num_tokens,
                                      new_block_ids=())
                       for s in seq_ids)
        return SchedulerOutput(step_index=step_index, chunks=chunks)

    base = step_fingerprint(0, output(3, (1, 2), 4))
    assert base == step_fingerprint(0, output(3, (1, 2), 4))
    others = [step_fingerprint(1, output(3, (1, 2), 4)), step_fingerprint(0, output(4, (1, 2), 4)),
              step_fingerprint(0, output(3, (1, 3), 4)), step_fingerprint(0, output(3, (1, 2), 5))]
    assert base not in others and 0 <= base < 2**62
