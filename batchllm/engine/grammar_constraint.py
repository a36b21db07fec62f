"""The StepConstraint of a step with structured-output rows (docs/design.md, "Structured outputs")."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from batchllm.engine.request_columns import RequestColumns
from batchllm.engine.sampler import TokenBitmask
from batchllm.ops.transfer import PinnedStaging
from batchllm.structured.errors import StructuredOutputError

if TYPE_CHECKING:  # xgrammar loads only for structured outputs
    from batchllm.structured.token_bitmask import TokenBitmaskFiller


class GrammarConstraint:
    """Asked for the bitmask once the step's forward is queued: first every earlier step's tokens
    are read (their grammars advance; with asynchronous scheduling the previous step is read here,
    while this step's forward runs), then the bitmask of the rows still running is filled."""

    def __init__(self, columns: RequestColumns, rows: np.ndarray, index: np.ndarray, num_rows: int,
                 filler: TokenBitmaskFiller, read_earlier_steps: Callable[[], None]) -> None:
        """rows: the sampled rows whose requests have a grammar, ascending; index: those requests'
        columns; num_rows: the step's sampled rows."""
        self.columns = columns
        self.rows = rows.tolist()
        self.index = index.tolist()
        self.num_rows = num_rows
        self.filler = filler
        self.read_earlier_steps = read_earlier_steps

    def token_bitmask(self, vocab_size: int, staging: PinnedStaging) -> TokenBitmask | None:
        self.read_earlier_steps()
        rows, grammars = [], []
        columns = self.columns
        for row, i in zip(self.rows, self.index):
            if columns.finished[i]:
                continue  # finished by the tokens just read: its row is dropped
            state = columns.states[i]
            try:
                state.grammar.matcher  # noqa: B018 - waits for its compile
            except StructuredOutputError as error:
                columns.fail(i, str(error))
                continue
            rows.append(row)
            grammars.append(state.grammar)
        if not rows:
            return None
        every_row = len(rows) == self.num_rows  # (rows ascend: every row, in order)
        return TokenBitmask(*self.filler.fill(grammars, rows, vocab_size, staging), every_row=every_row)
