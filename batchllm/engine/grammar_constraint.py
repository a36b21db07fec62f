"""The StepConstraint of a step with structured-output rows (docs/design.md, "Structured outputs")."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from batchllm.engine.request_state import RequestState
from batchllm.engine.sampler import TokenBitmask
from batchllm.ops.transfer import PinnedStaging
from batchllm.structured.errors import StructuredOutputError

if TYPE_CHECKING:  # xgrammar loads only for structured outputs
    from batchllm.structured.token_bitmask import TokenBitmaskFiller


class GrammarConstraint:
    """Asked for the bitmask once the step's forward is queued: first every earlier step's tokens
    are read (their grammars advance; with asynchronous scheduling the previous step is read here,
    while this step's forward runs), then the bitmask of the rows still running is filled."""

    def __init__(self, rows: list[tuple[int, RequestState]], num_rows: int, filler: TokenBitmaskFiller,
                 read_earlier_steps: Callable[[], None]) -> None:
        """rows: (sampled row, its request) of each row whose request has a grammar, in row order;
        num_rows: the step's sampled rows."""
        self.rows = rows
        self.num_rows = num_rows
        self.filler = filler
        self.read_earlier_steps = read_earlier_steps

    def token_bitmask(self, vocab_size: int, staging: PinnedStaging) -> TokenBitmask | None:
        self.read_earlier_steps()
        rows, grammars = [], []
        for row, state in self.rows:
            if state.finish_reason is not None:
                continue  # finished by the tokens just read: its row is dropped
            try:
                state.grammar.matcher  # noqa: B018 - waits for its compile
            except StructuredOutputError as error:
                state.error, state.finish_reason = str(error), "error"
                continue
            rows.append(row)
            grammars.append(state.grammar)
        if not rows:
            return None
        every_row = len(rows) == self.num_rows  # (rows ascend: every row, in order)
        return TokenBitmask(*self.filler.fill(grammars, rows, vocab_size, staging), every_row=every_row)
