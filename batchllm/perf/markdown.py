"""A benchmark result (runner.run_bench) as a Markdown table: one line per row. Torch-free."""

from __future__ import annotations

from batchllm.perf.flop_bound import H200_BF16_PEAK_FLOPS, H200_FP8_PEAK_FLOPS
from batchllm.perf.roofline import H200_COPY_BANDWIDTH_BYTES_PER_S

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
    ("roofline s", "roofline_s", "{:.3g}"),
    ("time / roofline", "time_over_roofline", "{:,.2f}"),
    ("serial roofline s", "serial_roofline_s", "{:.3g}"),
    ("time / serial roofline", "time_over_serial_roofline", "{:,.2f}"),
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


def engine_label(row: dict) -> str:
    """'fp8 / fp8' for quantization fp8 with an FP8 KV cache, 'none / auto' for neither; ' / TP2'
    appended above one GPU."""
    label = f"{row.get('quantization') or 'none'} / {row.get('kv_cache_dtype', 'auto')}"
    if row.get("tensor_parallel_size", 1) > 1:
        label += f" / TP{row['tensor_parallel_size']}"
    return label


def _shows_engine(rows: list[dict]) -> bool:
    """The engine column appears once some row ran anything but the default engine."""
    return any(engine_label(row) != "none / auto" for row in rows)


def sweep_note(row: dict) -> str | None:
    """'- hf-generate on W: batch 64: 8.45 req/s; batch 128: 8.49 req/s (reported)' for a peer row."""
    if not row.get("sweep"):
        return None
    parts = []
    for entry in row["sweep"]:
        batch = f"batch {entry['batch_size']}" + (" (bisected)" if entry.get("refined") else "")
        if "error" in entry:
            parts.append(f"{batch}: failed ({entry['error']})")
            continue
        reported = " (reported)" if entry["batch_size"] == row.get("batch_size") else ""
        parts.append(f"{batch}: {entry['req_per_s']:.2f} req/s over {entry['requests']} requests{reported}")
    return f"- {row.get('policy')} on {row.get('workload')}: " + "; ".join(parts)


def render_markdown(result: dict) -> str:
    """Title line, a table of every row (failed policies show their error), notes."""
    title = (f"### {result.get('model', '?')} on {result.get('device', '?')} "
             f"({result.get('date', '?')}, commit {result.get('git_commit') or '?'})")
    rows = result.get("rows", [])
    columns = list(COLUMNS)
    num_label_columns = 2  # workload, policy (then the engine when shown): left-aligned, kept on failed rows
    if _shows_engine(rows):
        columns.insert(2, ("quantization / KV cache", "engine", "{}"))
        num_label_columns = 3
    lines = [title, "", "| " + " | ".join(header for header, _, _ in columns) + " |",
             "|" + "|".join("---" if i < num_label_columns else "---:" for i in range(len(columns))) + "|"]
    errors = []
    for row in rows:
        row = {**row, "engine": engine_label(row)}
        if "error" in row:
            errors.append(f"- {row.get('workload')} / {row.get('policy')}: failed: {row['error']}")
            cells = [_cell(row, key, form) for _, key, form in columns[:num_label_columns]]
            cells.append("failed")
            cells += ["–"] * (len(columns) - len(cells))
        else:
            cells = [_cell(row, key, form) for _, key, form in columns]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    fp8_bound = (f"; rows with quantization fp8 at {H200_FP8_PEAK_FLOPS / 1e12:.0f} TFLOP/s (H200 FP8)"
                 if any(row.get("quantization") == "fp8" for row in rows) else "")
    kv_bytes = (f"{result['kv_bytes_per_token']} bytes per token" if "kv_bytes_per_token" in result
                else "the row's KV bytes per token (kv_bytes_per_token in the JSON rows)")
    lines.append(f"Outputs forced to max_tokens (EOS ignored). time / bound: wall time over the FLOP bound with "
                 f"optimal prefix sharing at {H200_BF16_PEAK_FLOPS / 1e12:.0f} TFLOP/s (H200 bf16){fp8_bound}. "
                 "valleys: steps under half the token budget. peak KV GiB: peak KV blocks x block size x "
                 f"{kv_bytes}. roofline s: the sum over the run's steps of max(FLOPs / that peak, bytes read / "
                 f"{H200_COPY_BANDWIDTH_BYTES_PER_S / 1e12:.1f} TB/s (H200 copy ceiling)), the bytes being every "
                 "weight, the LM head when a row samples and the KV each step attends (a prefix-sharing group's "
                 "prefix once); time / roofline: wall time over it. serial roofline s: the same with each step's "
                 "linear layers (and LM head) and its attention each at its own max(FLOPs / peak, bytes / "
                 "bandwidth), one after the other, as the engine runs them.")
    for entry in result.get("inputs", []):
        lines.append(f"- input {entry['file']}: {entry['requests']} requests, {entry['skipped_lines']} lines skipped")
    for entry in result.get("load_errors", []):
        lines.append(f"- not run: {entry['error']}")
    lines.extend(note for note in map(sweep_note, rows) if note)
    lines.extend(errors)
    return "\n".join(lines) + "\n"
