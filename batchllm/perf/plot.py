"""Tokens-per-iteration timelines of step traces (BatchLLM Fig. 2 / Fig. 9): one panel per trace,
the tokens of every iteration stacked by kind, with the token budget and the valley line.
Used by `batchllm plot` and by `batchllm bench --trace-dir`."""

from __future__ import annotations


def plot_timelines(traces: list, output_path: str, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(traces), 1, figsize=(11, 2.6 * len(traces)), squeeze=False, sharey=True)
    for axis, trace in zip(axes[:, 0], traces):
        steps = range(len(trace.steps))
        decode = [s.num_decode_tokens for s in trace.steps]
        distinct = [s.num_distinct_tokens for s in trace.steps]
        prefix = [s.num_prefix_tokens for s in trace.steps]
        axis.stackplot(steps, decode, distinct, prefix, labels=("decode", "distinct prompt", "common prefix"),
                       colors=("#4c72b0", "#dd8452", "#55a868"), linewidth=0)
        budget = trace.max_num_batched_tokens
        axis.axhline(budget, color="black", linewidth=0.8, linestyle="--", label="token budget")
        axis.axhline(budget / 2, color="red", linewidth=0.8, linestyle=":", label="valley line (budget/2)")
        num_tokens = [s.num_tokens for s in trace.steps]
        valleys = sum(1 for n in num_tokens if n < budget / 2)
        mean = sum(num_tokens) / len(num_tokens) if num_tokens else 0.0
        label = f" - {trace.label}" if trace.label else ""
        axis.set_title(f"{trace.policy}{label}: {len(num_tokens)} iterations, {mean:.0f} tokens/iter, {valleys} valleys",
                       fontsize=9)
        axis.set_ylabel("tokens / iteration")
        axis.set_xlim(0, max(1, len(num_tokens)))
    axes[-1, 0].set_xlabel("iteration")
    axes[0, 0].legend(loc="upper right", fontsize=7, ncol=5)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(output_path, dpi=110)
    plt.close(figure)
