"""Progress bar for long runs: requests done, req/s and generated tok/s."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, enabled: bool = True, description: str = "requests") -> None:
        self.total = total
        self.started = time.perf_counter()
        self.num_tokens = 0
        self.num_done = 0
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=description, unit="req", dynamic_ncols=True, file=sys.stderr)

    def update(self, num_finished: int, num_new_tokens: int) -> None:
        self.num_done += num_finished
        self.num_tokens += num_new_tokens
        if self._bar is None:
            return
        self._bar.update(num_finished)
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self._bar.set_postfix_str(f"{self.num_done / elapsed:.2f} req/s, {self.num_tokens / elapsed:.1f} tok/s",
                                  refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
