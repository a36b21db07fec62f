"""Progress bar of a run: how much of the total is done, and one rate, the requests the engine
answered per second since generation started (model loading and lines that needed no generation
left out), from which the time left is estimated. Token rates are reported once, in the run's
summary."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

_BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}]"


class _Bar(tqdm):
    """tqdm, its rate (and so its time left) taken from Progress instead of tqdm's own average."""

    rate_source = None

    @property
    def format_dict(self):
        values = super().format_dict
        if not self.disable and self.rate_source is not None:
            values["rate"] = self.rate_source()
        return values


class Progress:
    """The bar appears on the first item done or at start(), so that what a run prints before
    (loading the model) stands on its own lines."""

    def __init__(self, total: int, enabled: bool = True, description: str = "requests", unit: str = "requests") -> None:
        self.num_answered = 0  # by the engine, since start()
        self._total, self._enabled, self._description, self._unit = total, enabled, description, unit
        self._started_s: float | None = None
        self._last_answer_s: float | None = None
        self._bar: _Bar | None = None

    def start(self) -> None:
        """Generation starts now: the rate counts from here (the first call counts)."""
        if self._started_s is None:
            self._started_s = time.perf_counter()
            self._shown()

    def rate(self) -> float | None:
        """Requests answered per second of generation, up to the latest answer; None before it."""
        if self._started_s is None or self._last_answer_s is None:
            return None
        return self.num_answered / max(self._last_answer_s - self._started_s, 1e-9)

    def skip(self, num_items: int) -> None:
        """Items done without generation (a line that became an error record, or one answered by an
        earlier run): on the bar, not in the rate."""
        self._shown().update(num_items)

    def update(self, num_finished: int, num_new_tokens: int) -> None:
        """The engine's on_step: num_finished requests answered in this step."""
        self.start()
        if num_finished:
            self.num_answered += num_finished
            self._last_answer_s = time.perf_counter()
        self._shown().update(num_finished)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def _shown(self) -> _Bar:
        if self._bar is None:
            self._bar = _Bar(total=self._total, desc=self._description, unit=f" {self._unit}", dynamic_ncols=True,
                             file=sys.stderr, disable=not self._enabled, bar_format=_BAR_FORMAT)
            self._bar.rate_source = self.rate
        return self._bar
