"""The last-token column: a decode row's input is the id its persistent-batch row sampled last,
gathered on the device (the same code on CPU, where the column is a CPU tensor)."""

import dataclasses

import pytest
import torch

from batchllm.config import engine_config
from batchllm.engine.last_tokens import FedRows, LastTokenColumn
from batchllm.engine.llm_engine import LLMEngine
from batchllm.engine.sampler import sampling_row
from batchllm.sampling_params import SamplingParams
from batchllm.sched.interface import ScheduledChunk, SchedulerOutput

GREEDY = sampling_row(SamplingParams(temperature=0.0, logprobs=3), 0, 0)


def test_store_fit_and_feed():
    column = LastTokenColumn(torch.device("cpu"), 4)
    column.store(torch.tensor([2, 0]), torch.tensor([70, 50]))
    column.fit(9)  # the persistent batch grew: the ids stay
    assert column.token_ids.tolist() == [50, 0, 70, 0, 0, 0, 0, 0, 0]
    input_ids = torch.tensor([1, 2, 3, 4])
    column.feed(input_ids, FedRows(torch.tensor([1, 3]), torch.tensor([2, 0]), every_row=False))
    assert input_ids.tolist() == [1, 70, 3, 50]
    static = torch.full((6,), -1)  # a graph's input ids, padded past the step's rows
    column.feed(static, FedRows(torch.tensor([0, 1]), torch.tensor([0, 2]), every_row=True))
    assert static.tolist() == [50, 70, -1, -1, -1, -1]
    column.feed(static, None)
    assert static.tolist() == [50, 70, -1, -1, -1, -1]


@pytest.fixture(scope="module")
def runner():
    engine = LLMEngine(engine_config("random:tiny", dtype="float32", device="cpu", kv_cache_tokens=1024))
    return engine.runner


def _chunk(seq_id: int, token_ids: tuple[int, ...], start: int, num_tokens: int, **fields) -> ScheduledChunk:
    return ScheduledChunk(seq_id=seq_id, token_ids=token_ids, start_position=start, num_tokens=num_tokens,
                          sample=True, **fields)


def _with_ids(output: SchedulerOutput, ids: dict[int, int]) -> SchedulerOutput:
    """The same step with every fed row's id on the host."""
    return dataclasses.replace(output, chunks=tuple(
        dataclasses.replace(c, token_ids=(ids[c.seq_id],)) if not c.token_ids else c for c in output.chunks))


def test_fed_decode_rows_run_like_their_ids(runner):
    """Two prompts sample in one step; the next step feeds those tokens back from the column: the
    same hidden states and samples as the step with the ids given on the host, whether every row
    is fed or the fed rows sit among a prompt chunk's rows."""
    prefill = SchedulerOutput(0, (_chunk(0, (3, 4, 5, 6, 7), 0, 5, new_block_ids=(0,)),
                                  _chunk(1, (9, 8, 7), 0, 3, new_block_ids=(1,))))
    first = runner.execute(prefill, [GREEDY, GREEDY])
    sampled = dict(zip(first.seq_ids, first.sampled.token_ids.tolist()))
    decode = SchedulerOutput(1, (_chunk(0, (), 5, 1, new_block_ids=(), block_ids_start=1, is_decode=True),
                                 _chunk(1, (), 3, 1, new_block_ids=(), block_ids_start=1, is_decode=True)))
    mixed = dataclasses.replace(decode, chunks=(_chunk(2, (11, 12), 0, 2, new_block_ids=(2,)), *decode.chunks))
    with torch.inference_mode():
        for step in (decode, mixed):
            inputs = runner.step_inputs(step)
            assert inputs.fed_rows.size == 2 and inputs.input_ids[inputs.fed_rows].tolist() == [0, 0]
            fed = runner.forward(inputs)
            given = runner.forward(runner.step_inputs(_with_ids(step, sampled)))
            assert torch.equal(fed, given)
    # Through execute: the sampled ids of the fed step, and the column now holds them.
    fed_result = runner.execute(decode, [GREEDY, GREEDY])
    given_result = runner.execute(_with_ids(decode, sampled), [GREEDY, GREEDY])
    assert torch.equal(fed_result.sampled.token_ids, given_result.sampled.token_ids)
    assert torch.equal(fed_result.sampled.logprobs, given_result.sampled.logprobs)
    rows = runner.step_inputs(decode).sample_batch_rows
    assert runner.last_tokens.token_ids[torch.from_numpy(rows)].tolist() == given_result.sampled.token_ids.tolist()


def test_the_request_and_the_scheduler_hold_one_list_of_tokens():
    from batchllm.engine.request_state import PreparedRequest, RequestState
    from batchllm.engine.stop_checker import StopChecker

    params = SamplingParams(max_tokens=4)
    state = RequestState(PreparedRequest(3, [5, 6], params), StopChecker(params, 4, frozenset(), str), 0, None)
    request = state.sched_request()
    state.add_token(9, None)
    assert request.output_token_ids is state.output_token_ids and request.output_token_ids == [9]
    assert (request.request_id, request.prompt_token_ids, request.max_tokens) == (3, [5, 6], 4)
    assert state.output_index(3) == 1  # the token sampled after prompt + 1 output
