"""The device penalty op and count table against plain PyTorch, the host's slots and min_tokens
bans, counts under preemption and recompute, min_tokens against an EOS pushed early, seeded
sampling with penalties."""

import numpy as np
import pytest
import torch

from batchllm.engine import request_columns as request_columns_module
from batchllm.engine import step_loop as step_loop_module
from batchllm.engine.llm_engine import PreparedRequest, RunStats
from batchllm.engine.penalties import COUNT_MAX, PenaltyBatch, PenaltyTable, apply_penalties
from batchllm.engine.request_columns import RequestColumns
from batchllm.engine.request_state import RequestState
from batchllm.engine.run_options import RunOptions
from batchllm.engine.sampler import SamplingBatch, sample, sampling_row
from batchllm.engine.sampling_rows import PenaltyRows, SamplingRows
from batchllm.engine.stop_checker import StopChecker
from batchllm.ops.penalty_kernels import penalize_rows, penalize_rows_reference
from batchllm.sampling_params import SamplingParams

pytest_plugins = ["model_fixtures"]

CPU = torch.device("cpu")
EMPTY = np.zeros(0, dtype=np.int64)


def _reference(logits, counts, prompt_seen, presence, frequency, repetition):
    """Row by row, id by id: vLLM's order (repetition, then frequency and presence)."""
    out = logits.clone()
    for row in range(logits.shape[0]):
        for token in range(logits.shape[1]):
            value, count = float(logits[row, token]), int(counts[row, token])
            if count > 0 or bool(prompt_seen[row, token]):
                value = value / float(repetition[row]) if value > 0 else value * float(repetition[row])
            value -= float(frequency[row]) * count + float(presence[row]) * (count > 0)
            out[row, token] = value
    return out


def _random_case(generator, num_rows=5, vocab_size=37):
    logits = torch.randn(num_rows, vocab_size, generator=generator) * 3
    logits[0, 3] = float("-inf")  # a banned id stays banned
    counts = torch.randint(0, 4, (num_rows, vocab_size), generator=generator) * (
        torch.rand(num_rows, vocab_size, generator=generator) < 0.3)
    prompt_seen = torch.rand(num_rows, vocab_size, generator=generator) < 0.2
    presence = torch.rand(num_rows, generator=generator) * 4 - 2
    frequency = torch.rand(num_rows, generator=generator) * 4 - 2
    repetition = torch.rand(num_rows, generator=generator) * 2 + 0.1
    return logits, counts.to(torch.int16), prompt_seen, presence, frequency, repetition


def test_apply_penalties_equals_the_plain_reference_on_random_data():
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        case = _random_case(generator)
        torch.testing.assert_close(apply_penalties(*case), _reference(*case), rtol=1e-6, atol=1e-6)


def test_the_triton_kernel_equals_its_reference_and_the_op():
    generator = torch.Generator().manual_seed(2)
    logits, counts, prompt_seen, presence, frequency, repetition = _random_case(generator, num_rows=5,
                                                                                vocab_size=1500)
    table_counts = torch.zeros(7, 1500, dtype=torch.int16)
    table_seen = torch.zeros(7, 1500, dtype=torch.bool)
    slots = torch.tensor([6, 0, 3])
    penalised_rows = [0, 2, 4]
    table_counts[slots], table_seen[slots] = counts[penalised_rows], prompt_seen[penalised_rows]
    penalty_index = torch.tensor([0, -1, 1, -1, 2], dtype=torch.int32)
    args = (logits, penalty_index, slots, presence[:3], frequency[:3], repetition[:3], table_counts, table_seen)
    out, reference = penalize_rows(*args), penalize_rows_reference(*args)
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-5)
    expected = logits.clone()
    expected[penalised_rows] = apply_penalties(logits[penalised_rows], counts[penalised_rows],
                                               prompt_seen[penalised_rows], presence[:3], frequency[:3], repetition[:3])
    torch.testing.assert_close(reference, expected, rtol=1e-6, atol=1e-5)
    assert torch.equal(out[[1, 3]], logits[[1, 3]])  # rows without a penalty are copied


def _penalty_rows(rows, slots, num_slots, new_slots=EMPTY, prompt=(EMPTY, EMPTY), bans=(EMPTY, EMPTY),
                  presence=0.5, frequency=0.25, repetition=1.5):
    k = len(rows)
    return PenaltyRows(np.array(rows, dtype=np.int64), np.array(slots, dtype=np.int64),
                       np.full(k, presence, dtype=np.float32), np.full(k, frequency, dtype=np.float32),
                       np.full(k, repetition, dtype=np.float32), num_slots, np.asarray(new_slots, dtype=np.int64),
                       np.asarray(prompt[0], dtype=np.int64), np.asarray(prompt[1], dtype=np.int64),
                       np.asarray(bans[0], dtype=np.int64), np.asarray(bans[1], dtype=np.int64))


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [0, 1], [1, 3]])  # every row, leading rows, gathered rows
def test_the_table_penalises_its_rows_and_counts_their_tokens(rows, use_triton):
    vocab_size, num_rows = 11, 4
    table = PenaltyTable(CPU, use_triton=use_triton)
    slots = [2, 0, 1, 3][:len(rows)]
    prompt = ([slots[0]] * 3, [4, 5, 4])  # the first row's prompt holds ids 4 and 5
    first = PenaltyBatch.build(_penalty_rows(rows, slots, 4, new_slots=slots, prompt=prompt), num_rows, CPU)
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(1))
    penalised = table.apply(logits, first)
    zero = torch.zeros(len(rows), vocab_size, dtype=torch.int16)
    seen = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
    seen[0, [4, 5]] = True
    expected = logits.clone()
    expected[rows] = _reference(logits[rows], zero, seen, *(torch.tensor(v).expand(len(rows)) for v in (.5, .25, 1.5)))
    torch.testing.assert_close(penalised, expected, rtol=1e-6, atol=1e-6)
    sampled = torch.tensor([7, 8, 9, 10])
    table.count(first, sampled)
    table.count(first, sampled)
    for row, slot in zip(rows, slots):
        assert table.counts[slot].tolist() == [2 if t == int(sampled[row]) else 0 for t in range(vocab_size)]
    assert table.prompt_seen[slots[0]].nonzero().flatten().tolist() == [4, 5]
    # the slot starts again for another request: counts and prompt marks at zero
    again = PenaltyBatch.build(_penalty_rows(rows[:1], slots[:1], 4, new_slots=slots[:1]), num_rows, CPU)
    table.apply(logits, again)
    assert not table.counts[slots[0]].any() and not table.prompt_seen[slots[0]].any()
    assert table.num_bytes == 8 * vocab_size * 3  # 8 slots (the least it holds), int16 + bool


def test_counts_saturate_and_the_table_grows_keeping_them():
    table = PenaltyTable(CPU)
    batch = PenaltyBatch.build(_penalty_rows([0], [1], 2, new_slots=[1]), 1, CPU)
    table.apply(torch.zeros(1, 5), batch)
    table.counts[1, 3] = COUNT_MAX - 1
    for _ in range(3):
        table.count(batch, torch.tensor([3]))
    assert int(table.counts[1, 3]) == COUNT_MAX
    grown = PenaltyBatch.build(_penalty_rows([0], [1], 20), 1, CPU)
    table.apply(torch.zeros(1, 5), grown)
    assert table.counts.shape[0] >= 20 and int(table.counts[1, 3]) == COUNT_MAX


def test_bans_set_their_ids_to_minus_infinity_only():
    table = PenaltyTable(CPU)
    logits = torch.randn(3, 6)
    batch = PenaltyBatch.build(_penalty_rows([], [], 0, bans=([0, 0, 2, 2], [1, 5, 1, 99])), 3, CPU)
    banned = table.apply(logits, batch)
    expected = logits.clone()
    expected[0, [1, 5]] = expected[2, 1] = float("-inf")  # an id past the vocabulary bans nothing
    torch.testing.assert_close(banned, expected)
    assert table.counts is None  # a step with bans only holds no table


def test_sample_penalises_before_greedy_and_keeps_the_models_logprobs():
    table = PenaltyTable(CPU)
    logits = torch.tensor([[1.0, 3.0, 2.9, 0.0], [1.0, 3.0, 2.9, 0.0]])
    rows = SamplingRows.from_tuples([sampling_row(SamplingParams(temperature=0, logprobs=1), 0, 0)] * 2)
    penalties = _penalty_rows([1], [0], 1, new_slots=[0], prompt=([0], [1]), presence=0, frequency=0,
                              repetition=2.0)
    batch = SamplingBatch.build(SamplingRows(*[getattr(rows, f) for f in (
        "temperature", "top_p", "top_k", "min_p", "seeds", "output_index", "logprobs", "logit_bias_rows",
        "logit_bias")], penalties=penalties), CPU)
    out = sample(logits, batch, penalty_table=table)
    assert out.token_ids.tolist() == [1, 2]  # row 1: id 1 is in its prompt, 3 / 2 < 2.9
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1)[[0, 1], [1, 2]])
    assert table.counts[0].tolist() == [0, 0, 1, 0]
    with pytest.raises(ValueError, match="PenaltyTable"):
        sample(logits, batch)


# -- the host's slots and bans --------------------------------------------------------------------------------


def _states(params_list, eos=frozenset({2})):
    states = {}
    for i, params in enumerate(params_list):
        request = PreparedRequest(i, [5 + i, 6, 7], params)
        states[i] = RequestState(request, StopChecker(params, params.max_tokens, eos, lambda ids: ""), i, None)
    return states


def test_slots_are_taken_at_first_sample_and_taken_back_after_finish():
    params = [SamplingParams(max_tokens=8, repetition_penalty=1.2), SamplingParams(max_tokens=8),
              SamplingParams(max_tokens=8, presence_penalty=1.0), SamplingParams(max_tokens=8, frequency_penalty=-1)]
    columns = RequestColumns(_states(params))
    assert columns.sampling_rows(np.array([1]), np.array([0])).penalties is None  # nothing to pay
    first = columns.sampling_rows(np.array([0, 1, 2]), np.array([0, 0, 0])).penalties
    assert first.rows.tolist() == [0, 2] and first.num_slots == 2
    assert sorted(first.slots.tolist()) == sorted(first.new_slots.tolist()) == [0, 1]
    slot0 = int(first.slots[0])
    assert first.prompt_slots.tolist() == [slot0] * 3 and first.prompt_token_ids.tolist() == [5, 6, 7]  # request 0
    second = columns.sampling_rows(np.array([2, 0]), np.array([1, 1])).penalties
    assert second.new_slots.size == 0 and second.slots.tolist() == [int(first.slots[1]), slot0]
    columns.fail(0, "done")
    later = columns.sampling_rows(np.array([3, 0]), np.array([0, 2])).penalties
    # request 3 reuses finished request 0's slot; request 0's dropped row is not penalised
    assert later.rows.tolist() == [0] and later.slots.tolist() == [slot0] and later.new_slots.tolist() == [slot0]
    assert later.num_slots == 2 and later.prompt_slots.size == 0


def test_min_tokens_bans_eos_and_stop_ids_until_min_tokens():
    params = [SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[9, 4]), SamplingParams(max_tokens=8),
              SamplingParams(max_tokens=8, min_tokens=3, ignore_eos=True, stop_token_ids=[7]),
              SamplingParams(max_tokens=8, min_tokens=1, ignore_eos=True)]
    columns = RequestColumns(_states(params))
    rows = columns.sampling_rows(np.array([3, 2, 1, 0]), np.array([0, 2, 0, 1])).penalties
    assert rows.rows.size == 0
    assert list(zip(rows.ban_rows.tolist(), rows.ban_token_ids.tolist())) == [(1, 7), (3, 2), (3, 4), (3, 9)]
    assert columns.sampling_rows(np.array([0, 2]), np.array([2, 3])).penalties is None


def test_the_fast_path_does_not_stop_on_eos_before_min_tokens():
    columns = RequestColumns(_states([SamplingParams(max_tokens=8, min_tokens=2)]))
    columns.read(np.array([0]), np.array([2]))
    assert not columns.finished[0]
    columns.read(np.array([0]), np.array([2]))
    assert columns.finished[0] and columns.states[0].finish_reason == "stop"


def test_stop_strings_and_ids_wait_for_min_tokens():
    params = SamplingParams(max_tokens=10, min_tokens=3, stop=["ab", "b"], stop_token_ids=[99])
    checker = StopChecker(params, 10, frozenset(), lambda ids: "".join(chr(i) for i in ids))
    text = [ord(c) for c in "abab"]
    assert [checker.check(text[:n]) for n in (1, 2, 3)] == [None, None, None]  # "ab", "b" inside the first 3 tokens
    # only a match that ends past them counts: the second "ab" (not the first "b")
    assert checker.check(text) == "stop" and (checker.stop_string, checker.stop_text) == ("ab", "ab")
    ids = StopChecker(params, 10, frozenset(), lambda ids: "")
    assert [ids.check([99] * n) for n in (1, 2, 3)] == [None, None, "stop"]


# -- the engine ----------------------------------------------------------------------------------------------

def _tiny_requests(num_requests, **penalties):
    requests = []
    for i in range(num_requests):
        document = [10 + (i % 3)] * 40 + list(range(100, 100 + (i % 3) * 5))  # 3 prefix groups
        prompt = document + [200 + i, 300 + (i * 7) % 50, 400 + i % 11]
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=6 + i % 9, ignore_eos=True, seed=i,
                                **(penalties if i % 4 != 3 else {}))
        requests.append(PreparedRequest(i, prompt, params))
    return requests


@pytest.fixture
def captured_columns(monkeypatch):
    """The RequestColumns of each run (to read its slots afterwards)."""
    captured = []

    class Capturing(RequestColumns):
        def __init__(self, states):
            super().__init__(states)
            captured.append(self)

    monkeypatch.setattr(step_loop_module, "RequestColumns", Capturing)
    return captured


def _run(engine, requests, async_scheduling, stats=None):
    outputs = engine.run(requests, stats=stats, options=RunOptions(async_scheduling=async_scheduling))
    return {out.request_id: out.output_token_ids for out in outputs}


def test_counts_equal_the_outputs_under_preemption_and_recompute(tiny_engine, captured_columns):
    requests = _tiny_requests(24, presence_penalty=0.7, frequency_penalty=1.3, repetition_penalty=1.5)
    tiny_engine.configure_scheduler(policy="vllm", max_num_batched_tokens=64)
    roomy = {mode: _run(tiny_engine, requests, mode) for mode in (False, True)}
    num_kv_blocks = tiny_engine.num_kv_blocks
    tiny_engine.num_kv_blocks = 24  # too small for everyone: recompute preemption
    try:
        for mode in (False, True):
            stats = RunStats()
            tight = _run(tiny_engine, requests, mode, stats)
            assert sum(r.num_preempted_requests for r in stats.step_records) > 0
            assert tight == roomy[mode] == roomy[False]
            slots = captured_columns[-1].penalty_slots
            counts = tiny_engine.runner.penalty_table.counts
            held = np.flatnonzero(slots.slot >= 0).tolist()
            assert len(held) >= 4
            for i in held:  # each count is that of the request's output: replayed tokens not again
                expected = np.bincount(tight[i], minlength=counts.shape[1])
                assert counts[int(slots.slot[i])].tolist() == expected.tolist(), i
    finally:
        tiny_engine.num_kv_blocks = num_kv_blocks


def test_penalties_change_the_tokens_and_seeded_rows_stay_independent_of_their_neighbours(tiny_engine):
    plain = _run(tiny_engine, _tiny_requests(12), False)
    requests = _tiny_requests(12, frequency_penalty=2.0, repetition_penalty=1.8)
    penalised = _run(tiny_engine, requests, True)
    assert plain != penalised
    for i in (0, 2, 5):  # alone, a request samples the same tokens (seeded or greedy)
        assert _run(tiny_engine, [requests[i]], True)[i] == penalised[i]


def test_min_tokens_holds_off_an_eos_pushed_early(default_llm):
    eos = min(default_llm.engine.eos_token_ids)
    prompt = default_llm.engine.tokenizer.hf("Hello").input_ids
    params = [SamplingParams(temperature=0, max_tokens=12, min_tokens=5, logit_bias={eos: 100}),
              SamplingParams(temperature=0.9, seed=3, max_tokens=12, min_tokens=7, logit_bias={eos: 100}),
              SamplingParams(temperature=0, max_tokens=12, logit_bias={eos: 100}),
              SamplingParams(temperature=0, max_tokens=12, min_tokens=4, logit_bias={eos: 100}, logprobs=1,
                             stop_token_ids=[eos + 1])]
    for asynchronous in (False, True):
        results = default_llm.generate([prompt] * len(params), params, use_tqdm=False,
                                       options=RunOptions(async_scheduling=asynchronous))
        outputs = [r.outputs[0] for r in results]
        for output, min_tokens in zip(outputs, (5, 7, 0, 4)):
            # the EOS comes right after min_tokens tokens, none before
            assert len(output.token_ids) == min_tokens + 1 and output.token_ids[-1] == eos
            assert eos not in output.token_ids[:-1] and output.finish_reason == "stop"
        assert len(outputs[3].logprobs) == 5


def test_the_triton_path_gives_the_tokens_of_the_pytorch_path(tiny_engine, monkeypatch):
    requests = _tiny_requests(8, presence_penalty=-0.4, frequency_penalty=0.9, repetition_penalty=1.7)
    monkeypatch.setattr(tiny_engine.runner, "penalty_table", PenaltyTable(CPU, use_triton=False))
    reference = _run(tiny_engine, requests, True)
    monkeypatch.setattr(tiny_engine.runner, "penalty_table", PenaltyTable(CPU, use_triton=True))
    assert _run(tiny_engine, requests, True) == reference


def test_a_context_that_cuts_max_tokens_cuts_min_tokens_with_it():
    from batchllm.engine.request_limits import RequestLimits

    limits = RequestLimits(max_model_len=16, num_kv_blocks=100, block_size=16)
    params = limits.check(list(range(10)), SamplingParams(max_tokens=12, min_tokens=9))
    assert (params.max_tokens, params.min_tokens) == (6, 6)
    assert limits.check(list(range(10)), SamplingParams(max_tokens=5, min_tokens=4)).min_tokens == 4
