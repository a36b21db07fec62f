"""A request of n samples as n engine requests, and their outputs gathered back.

The samples share the request's prompt, so the prefix planner puts them in one group whose
prefix is the prompt less its last token: the prompt is computed once, and each sample computes
one token (the last) to sample from. Sample 0 keeps the request's id and seed (the seed the engine
would give it), so it is the request's n=1 answer; sample k samples with sample_seed(seed, k)
under a fresh id above every caller id. Only sample 0 computes the prompt's logprobs (when asked
for), which are the same for every sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from batchllm.engine.request_state import FinishedOutput, PreparedRequest
from batchllm.engine.sampler import mix_seed
from batchllm.sampling_params import sample_seed


@dataclass
class SampleSplit:
    """engine_seed: the engine's seed (EngineConfig.seed), which seeds a request without its own.
    first_free_id: the first id above every id the caller uses (its samples 1.. take ids from it)."""

    engine_seed: int
    first_free_id: int
    # of the requests of n > 1 only (a job of a million n = 1 lines holds nothing here)
    _owner: dict[int, tuple[int, int]] = field(default_factory=dict)  # engine id -> (request id, sample index)
    _outputs: dict[int, list[FinishedOutput | None]] = field(default_factory=dict)  # request id -> its samples

    def split(self, request: PreparedRequest) -> list[PreparedRequest]:
        """The engine requests of one request (itself when n = 1)."""
        params = request.params
        if params.n == 1:
            return [request]
        self._outputs[request.request_id] = [None] * params.n
        self._owner[request.request_id] = (request.request_id, 0)
        seed = params.seed if params.seed is not None else mix_seed(self.engine_seed, request.request_id)
        samples = [replace(request, params=replace(params, n=1, seed=seed))]
        for index in range(1, params.n):
            sample_id = self.first_free_id
            self.first_free_id += 1
            self._owner[sample_id] = (request.request_id, index)
            # the prompt's logprobs are sample 0's: the others skip them (a request that asks for
            # them shares no prefix)
            samples.append(PreparedRequest(sample_id, request.prompt_token_ids,
                                           replace(params, n=1, seed=sample_seed(seed, index), prompt_logprobs=None),
                                           request.prompt_array))
        return samples

    def gather(self, done: FinishedOutput) -> tuple[int, list[FinishedOutput]] | None:
        """(request id, its outputs in sample order, each with the request's id) once done was its
        last sample to finish; None before."""
        if done.request_id not in self._owner:  # a request of one sample
            return done.request_id, [done]
        request_id, index = self._owner.pop(done.request_id)
        outputs = self._outputs[request_id]
        outputs[index] = replace(done, request_id=request_id)
        if any(output is None for output in outputs):
            return None
        del self._outputs[request_id]
        return request_id, outputs
