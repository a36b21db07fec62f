"""Progress bar for long runs: requests done, req/s and generated tok/s."""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, enabled: bool = True, description: str = "requests") -> None:
        from tqdm import tqdm

        self.num_tokens = 0
        self._bar = tqdm(total=total, desc=description, unit="req", dynamic_ncols=True, file=sys.stderr,
                         disable=not enabled)

    def update(self, num_finished: int, num_new_tokens: int) -> None:
        if self._bar.disable:
            return
        self.num_tokens += num_new_tokens
        self._bar.update(num_finished)
        elapsed = max(self._bar.format_dict["elapsed"], 1e-9)
        self._bar.set_postfix_str(f"{self._bar.n / elapsed:.2f} req/s, {self.num_tokens / elapsed:.1f} tok/s",
                                  refresh=False)

    def close(self) -> None:
        self._bar.close()
