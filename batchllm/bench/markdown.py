"""A benchmark result (runner.run_bench) as a Markdown table: one line per row. Torch-free."""

from __future__ import annotations

from batchllm.bench.flop_bound import H200_BF16_PEAK_FLOPS

# (header, row key, format)
COLUMNS = (
    ("workload", "workload", "{}"),
    ("policy", "policy", "{}"),
    ("requests", "requests", "{}"),
    ("wall s", "seconds", "{:.2f}"),
    ("req/s", "req_per_s", "{:.2f}"),
    ("input tok/s", "input_tok_per_s", "{:,.0f}"),
    ("output tok/s", "output_tok_per_s", "{:,.0f}"),
    ("prefill tokens processed", "processed_prefill_tokens", "{:,}"),
    ("saving ratio", "saving_ratio", "{:.1%}"),
    ("mean tokens/step", "mean_tokens_per_step", "{:,.1f}"),
    ("valleys", "valley_steps", "{}"),
    ("peak KV GiB", "peak_kv_gib", "{:.3g}"),
    ("time / bound", "time_over_bound", "{:,.2f}"),
)


def _cell(row: dict, key: str, form: str) -> str:
    value = row.get(key)
    if value is None:
        return "–"
    try:
        text = form.format(value)
    except (ValueError, TypeError):
        text = str(value)
    return text.replace("|", "\\|")


def render_markdown(result: dict) -> str:
    """Title line, a table of every row (failed policies show their error), notes."""
    title = (f"### {result.get('model', '?')} on {result.get('device', '?')} "
             f"({result.get('date', '?')}, commit {result.get('git_commit') or '?'})")
    lines = [title, "", "| " + " | ".join(header for header, _, _ in COLUMNS) + " |",
             "|" + "|".join("---" if i < 2 else "---:" for i in range(len(COLUMNS))) + "|"]
    errors = []
    for row in result.get("rows", []):
        if "error" in row:
            errors.append(f"- {row.get('workload')} / {row.get('policy')}: failed: {row['error']}")
            cells = [_cell(row, "workload", "{}"), _cell(row, "policy", "{}"), "failed"]
            cells += ["–"] * (len(COLUMNS) - len(cells))
        else:
            cells = [_cell(row, key, form) for _, key, form in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Outputs forced to max_tokens (EOS ignored). time / bound: wall time over the FLOP bound with "
                 f"optimal prefix sharing at {H200_BF16_PEAK_FLOPS / 1e12:.0f} TFLOP/s (H200 bf16). "
                 "valleys: steps under half the token budget. peak KV GiB: peak KV blocks x block size x "
                 f"{result.get('kv_bytes_per_token', '?')} bytes per token.")
    for entry in result.get("inputs", []):
        lines.append(f"- input {entry['file']}: {entry['requests']} requests, {entry['skipped_lines']} lines skipped")
    lines.extend(errors)
    return "\n".join(lines) + "\n"
