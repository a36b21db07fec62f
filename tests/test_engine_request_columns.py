"""The step loop's request columns: tokens read as arrays, EOS and max_tokens checked as arrays,
Python per token only for requests with stop strings, stop ids or logprobs; the sampling rows
they give equal the rows sampling_row builds one at a time."""

import numpy as np
import torch

from batchllm.engine.request_columns import RequestColumns
from batchllm.engine.request_state import PreparedRequest, RequestState
from batchllm.engine.sampler import SamplingBatch, sampling_row
from batchllm.engine.sampling_rows import SamplingRows
from batchllm.engine.stop_checker import StopChecker
from batchllm.sampling_params import SamplingParams

EOS = frozenset({2})


def _state(request_id: int, params: SamplingParams) -> RequestState:
    stop = StopChecker(params, params.max_tokens, EOS, lambda ids: "".join(chr(97 + i % 26) for i in ids))
    return RequestState(PreparedRequest(request_id, [5, 6, 7], params), stop, 40 + request_id,
                        [] if params.logprobs is not None else None)


def _states() -> dict[int, RequestState]:
    params = {
        30: SamplingParams(max_tokens=3),  # ends by length
        10: SamplingParams(max_tokens=9),  # ends by EOS
        20: SamplingParams(max_tokens=9, ignore_eos=True),  # EOS is just a token
        40: SamplingParams(max_tokens=9, stop_token_ids=(8,)),  # Python: stop ids
        50: SamplingParams(max_tokens=9, stop=("d",)),  # Python: a stop string ("d" is token 3)
        60: SamplingParams(max_tokens=9, temperature=0.5, top_k=4, logit_bias=((11, 3.0),), logprobs=1),
    }
    return {request_id: _state(request_id, p) for request_id, p in params.items()}


def test_reads_and_stop_checks_over_arrays_match_the_stop_checker():
    states = _states()
    columns = RequestColumns(states)
    assert columns.request_ids.tolist() == [10, 20, 30, 40, 50, 60]
    assert columns.needs_python.tolist() == [False, False, False, True, True, True]
    index = columns.index_of(np.array([30, 10, 20]))
    assert index.tolist() == [2, 0, 1]
    assert columns.read(index, np.array([4, 4, 2])) == 3  # 20's EOS does not stop it
    assert columns.read(index, np.array([4, 2, 7])) == 3  # 10 stops on EOS
    assert columns.read(index[[0, 2]], np.array([9, 2])) == 2  # 30 reaches max_tokens 3
    assert [states[i].output_token_ids for i in (10, 20, 30)] == [[4, 2], [2, 7, 2], [4, 4, 9]]
    assert [states[i].finish_reason for i in (10, 20, 30)] == ["stop", None, "length"]
    assert columns.finished.tolist() == [True, False, True, False, False, False]
    assert columns.num_read.tolist()[:3] == [2, 3, 3]
    # the Python path: the request's own StopChecker, one token at a time
    for token in (4, 8):
        columns.read_one(3, token, None)
    columns.read_one(4, 3, None)
    assert (states[40].output_token_ids, states[40].finish_reason) == ([4, 8], "stop")
    assert (states[50].finish_reason, states[50].stop.stop_text) == ("stop", "")
    assert columns.finished.tolist() == [True, False, True, True, True, False]


def test_sampling_rows_equal_sampling_row_tuples():
    states = _states()
    columns = RequestColumns(states)
    index = columns.index_of(np.array([60, 10, 60]))
    rows = columns.sampling_rows(index, np.array([4, 1, 0]))
    expected = [sampling_row(states[60].request.params, states[60].seed, 4),
                sampling_row(states[10].request.params, states[10].seed, 1),
                sampling_row(states[60].request.params, states[60].seed, 0)]
    assert list(rows) == expected and len(rows) == 3
    assert rows.max_logprobs == 1 and rows.logit_bias_rows.tolist() == [0, 2]
    built, reference = (SamplingBatch.build(r, torch.device("cpu")) for r in (rows, expected))
    for name in ("temperature", "top_p", "top_k", "min_p", "seeds", "output_index"):
        assert torch.equal(getattr(built, name), getattr(reference, name)), name
    assert (built.all_greedy, built.needs_top_k, built.needs_top_p, built.needs_min_p, built.max_logprobs) == (
        False, True, False, False, 1)
    assert torch.equal(built.logit_bias.rows, torch.tensor([0, 2]))
    assert SamplingRows.from_tuples(expected)[1] == expected[1]


def test_index_of_contiguous_and_scattered_ids():
    import pytest

    contiguous = RequestColumns({i: _state(i, SamplingParams(max_tokens=2)) for i in (7, 5, 6)})
    assert contiguous.index_of(np.array([7, 5])).tolist() == [2, 0]
    scattered = RequestColumns({i: _state(i, SamplingParams(max_tokens=2)) for i in (9, 2, 4)})
    assert scattered.index_of(np.array([9, 2, 4])).tolist() == [2, 0, 1]
    for columns, unknown in ((contiguous, 8), (contiguous, 4), (scattered, 3), (scattered, 10)):
        with pytest.raises(KeyError):
            columns.index_of(np.array([unknown]))
