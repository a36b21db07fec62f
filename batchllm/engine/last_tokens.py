"""The persistent batch's last-token column: the id each row sampled last, kept on the device. A
decode row's input is gathered from it on the device, so a sampled id is fed back without a trip
through the host (docs/design.md, "The step loop and asynchronous scheduling")."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FedRows:
    """A step's decode rows whose input is their seq's last sampled id, on the device."""

    rows: torch.Tensor  # [num_fed] int64: the rows in the step
    batch_rows: torch.Tensor  # [num_fed] int64: their seqs' rows in the persistent batch
    every_row: bool  # rows are 0 .. num_fed - 1, the whole step: one gather writes them


class LastTokenColumn:
    """One int64 id per persistent-batch row (engine/batch_rows.py), on the runner's device (a CPU
    tensor on CPU: the same code path). Written after sampling, read by the next step of the row."""

    def __init__(self, device: torch.device, num_rows: int) -> None:
        self.token_ids = torch.zeros(num_rows, dtype=torch.int64, device=device)

    def fit(self, num_rows: int) -> None:
        """Room for rows below num_rows (the persistent batch grew), keeping every row's id."""
        old = self.token_ids.shape[0]
        if num_rows > old:
            grown = self.token_ids.new_zeros(num_rows)
            grown[:old] = self.token_ids
            self.token_ids = grown

    def feed(self, input_ids: torch.Tensor, fed: FedRows | None) -> None:
        """input_ids[fed.rows] = the ids kept at fed.batch_rows, on the device (no host sync)."""
        if fed is None:
            return
        if fed.every_row:
            torch.index_select(self.token_ids, 0, fed.batch_rows, out=input_ids[:fed.batch_rows.shape[0]])
        else:
            input_ids.index_copy_(0, fed.rows, self.token_ids.index_select(0, fed.batch_rows))

    def store(self, batch_rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Keep each sampled id (token_ids[i]) at its seq's row (batch_rows[i])."""
        self.token_ids.index_copy_(0, batch_rows, token_ids)
