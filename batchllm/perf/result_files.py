"""The files a bench run writes (--out JSON, --markdown table), rewritten whole after every row so
that a crash or an out-of-memory kill later in the run loses no measured row. Torch-free."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from batchllm.perf.markdown import render_markdown


@dataclass(frozen=True)
class ResultFiles:
    json_path: str | None = None
    markdown_path: str | None = None

    @property
    def paths(self) -> list[str]:
        return [path for path in (self.json_path, self.markdown_path) if path]

    def write(self, result: dict) -> None:
        """Replace both files with `result` (runner.run_bench's shape) and its table."""
        if self.json_path:
            _replace(self.json_path, json.dumps(result, indent=1))
        if self.markdown_path:
            _replace(self.markdown_path, render_markdown(result))


def report_result(result: dict, out_path: str | None) -> None:
    """A one-shot benchmark's result: printed as JSON, and written to out_path when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out_path:
        _replace(out_path, text + "\n")


def _replace(path: str, text: str) -> None:
    """Write next to `path`, then rename over it: a reader never sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "w") as handle:
        handle.write(text)
    os.replace(partial, path)
