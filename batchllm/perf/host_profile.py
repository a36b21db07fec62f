"""Where the host's launch time goes: a StepObserver that runs cProfile around each step's
ModelRunner.execute, kept apart by how the step ran (eagerly, through piecewise CUDA graphs or a
whole-step graph), and a summary of its host seconds by where the code lives. cProfile charges
time to every Python call it sees, so read the categories as shares of the profiled launch, not as its unprofiled length."""

from __future__ import annotations

import cProfile
import pstats

# (category, test on (file name, function name)), first match wins. Built-in functions have the
# file name "~" and a name such as "<method 'copy_' of 'torch._C.TensorBase' objects>".
CATEGORIES = (
    ("gpu_wait", lambda path, name: path == "~" and ("synchronize" in name or "'item'" in name)),
    ("triton_launcher", lambda path, name: "/triton/" in path or "cuda_utils" in path or "__triton_launcher" in path),
    ("torch_builtin_ops", lambda path, name: path == "~" and "torch" in name),
    ("torch_python", lambda path, name: "/torch/" in path),
    ("attention_plan", lambda path, name: "batchllm/attention_plan/" in path),
    ("batchllm_ops", lambda path, name: "batchllm/ops/" in path),
    ("batchllm_models", lambda path, name: "batchllm/models/" in path),
    ("batchllm_engine", lambda path, name: "batchllm/engine/" in path),
    ("numpy", lambda path, name: "numpy" in path or (path == "~" and "numpy" in name)),
    ("python_builtins", lambda path, name: path == "~"),
)


def category(path: str, name: str) -> str:
    """The category of a profiled function by its file and name (CATEGORIES), else "other"."""
    return next((c for c, test in CATEGORIES if test(path.replace("\\", "/"), name)), "other")


class HostProfiler:
    """A StepObserver (set it as ModelRunner.observer): cProfile around every execute, the
    statistics summed per kind of step: "eager", "piecewise" or "graph_replay"."""

    def __init__(self) -> None:
        self.stats: dict[str, pstats.Stats] = {}
        self.num_steps: dict[str, int] = {}
        self._profiler: cProfile.Profile | None = None

    def step_started(self, output) -> None:
        self._profiler = cProfile.Profile()
        self._profiler.enable()

    def step_launched(self, output, mode: str) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.disable()
        self.num_steps[mode] = self.num_steps.get(mode, 0) + 1
        if mode in self.stats:
            self.stats[mode].add(profiler)
        else:
            self.stats[mode] = pstats.Stats(profiler)

    def summary(self, top: int = 25) -> dict:
        """Per kind of step: its step count and summarize()'s figures."""
        return {kind: {"steps": self.num_steps[kind], **summarize(stats, self.num_steps[kind], top)}
                for kind, stats in self.stats.items()}


def summarize(stats: pstats.Stats, num_steps: int, top: int = 25) -> dict:
    """Host ms per step by category (each function's own time, callees excluded), and the
    functions with the most own time."""
    by_category: dict[str, float] = {}
    functions = []
    for (path, line, name), (_, num_calls, own_s, cumulative_s, _) in stats.stats.items():
        group = category(path, name)
        by_category[group] = by_category.get(group, 0.0) + own_s
        functions.append((own_s, num_calls, cumulative_s, f"{path}:{line}({name})", group))
    functions.sort(reverse=True)
    steps = max(num_steps, 1)
    return {
        "profiled_ms_per_step": round(1000 * sum(by_category.values()) / steps, 2),
        "category_ms_per_step": {k: round(1000 * v / steps, 2) for k, v in
                                 sorted(by_category.items(), key=lambda kv: -kv[1])},
        "top_functions": [{"function": where[-160:], "category": group, "calls_per_step": round(calls / steps, 1),
                           "own_ms_per_step": round(1000 * own / steps, 3),
                           "cumulative_ms_per_step": round(1000 * cumulative / steps, 3)}
                          for own, calls, cumulative, where, group in functions[:top]],
    }
