"""One request's place in its grammar: advanced by each token it samples."""

from __future__ import annotations

from concurrent.futures import Future

import xgrammar

from batchllm.sampling_params import StructuredOutputsParams
from batchllm.structured.errors import StructuredOutputError


class GrammarState:
    """Wraps an xgrammar GrammarMatcher, made from the compiled grammar at its first use (the
    compile runs in the backend's pool until then)."""

    def __init__(self, compiled: Future, spec: StructuredOutputsParams) -> None:
        self.spec = spec
        self._compiled = compiled
        self._matcher: xgrammar.GrammarMatcher | None = None

    @property
    def matcher(self) -> xgrammar.GrammarMatcher:
        """Waits for the grammar's compile the first time; StructuredOutputError if it failed."""
        if self._matcher is None:
            self._matcher = xgrammar.GrammarMatcher(self._compiled.result())
        return self._matcher

    def advance(self, token_id: int, finish_reason: str | None) -> str | None:
        """Accept the request's new token; the finish reason once it is known: "stop" when the
        grammar is complete (its end-of-sequence token accepted), else the stop checker's."""
        if not self.matcher.accept_token(token_id):
            raise StructuredOutputError(f"token {token_id} does not continue the {self.spec.source} grammar")
        return "stop" if self.matcher.is_terminated() else finish_reason

    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()
