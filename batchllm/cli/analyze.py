"""`batchllm analyze`: how much prefill the global prefix plan saves on a batch (BatchLLM 4.2).
Reads the same JSONL as `batchllm run`; prompts are tokenized as cli/prompt_tokens.py says."""

from __future__ import annotations

import json
import sys

from batchllm.cli.prompt_tokens import add_model_argument


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="plan prefix sharing for a batch and report the prefill tokens it saves",
        description=(
            "Plan the optimal prefix-sharing groups of a batch (no inference) and report logical vs\n"
            "processed prefill tokens and saving ratios: optimal single-level groups, multi-level\n"
            "sharing, naive first-level grouping. Lines with prompt_token_ids need no model; text\n"
            "and chat lines are tokenized with --model (default: the model `batchllm run` uses)."
        ),
    )
    parser.add_argument("input", metavar="INPUT.jsonl", help="OpenAI-Batch or short-form request lines")
    add_model_argument(parser)
    parser.add_argument("--groups", metavar="GROUPS.jsonl", default=None,
                        help="also write the prefix-sharing groups, one group per line")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(func=analyze_command)


def _read_token_ids(path: str, model: str | None):
    """(custom_ids, TokenStore of int32 prompts, error lines), streaming the file line by line.
    Text is tokenized only if some line needs it."""
    from batchllm.cli.prompt_tokens import read_prompts
    from batchllm.io.batch_input import BatchError
    from batchllm.io.token_store import TokenStore

    custom_ids: list[str] = []
    prompts = TokenStore()
    errors: list[str] = []
    for item, token_ids in read_prompts(path, model):
        if isinstance(item, BatchError):
            errors.append(f"line {item.line_number}: {item.code}: {item.message}")
        elif not token_ids:
            errors.append(f"line {item.line_number}: empty_prompt: the prompt encodes to 0 tokens")
        else:
            custom_ids.append(item.custom_id)
            prompts.append(token_ids)
    return custom_ids, prompts, errors


def _summary(stats, num_invalid_lines: int) -> dict:
    return {
        "requests": stats.num_requests,
        "invalid_lines": num_invalid_lines,
        "logical_prefill_tokens": stats.logical_prefill_tokens,
        "processed_prefill_tokens": stats.processed_prefill_tokens,
        "saved_prefill_tokens": stats.saved_prefill_tokens,
        "saving_ratio": stats.saving_ratio,
        "processed_prefill_tokens_multi_level": stats.processed_prefill_tokens_multi_level,
        "saving_ratio_multi_level": stats.saving_ratio_multi_level,
        "processed_prefill_tokens_naive_first_level": stats.processed_prefill_tokens_naive_first_level,
        "saving_ratio_naive_first_level": stats.saving_ratio_naive_first_level,
        "saving_ratio_no_sharing": stats.saving_ratio_no_sharing,
        "groups": stats.num_groups,
        "shared_groups": stats.num_shared_groups,
        "singletons": stats.num_singletons,
        "sharing_degree": stats.to_dict()["sharing_degree"],
        "prefix_num_tokens": stats.to_dict()["prefix_num_tokens"],
        "seconds": stats.planning_seconds,
    }


def _table(summary: dict) -> str:
    logical = summary["logical_prefill_tokens"]
    rows = [
        ("no sharing", logical, summary["saving_ratio_no_sharing"]),
        ("naive first-level groups", summary["processed_prefill_tokens_naive_first_level"],
         summary["saving_ratio_naive_first_level"]),
        ("optimal single-level groups", summary["processed_prefill_tokens"], summary["saving_ratio"]),
        ("multi-level (upper bound)", summary["processed_prefill_tokens_multi_level"],
         summary["saving_ratio_multi_level"]),
    ]
    lines = [
        f"requests                 {summary['requests']}"
        + (f"   ({summary['invalid_lines']} invalid lines skipped)" if summary["invalid_lines"] else ""),
        f"logical prefill tokens   {logical}",
        "",
        f"{'sharing':<30}{'processed tokens':>18}{'saving ratio':>14}",
    ]
    lines += [f"{name:<30}{processed:>18}{100 * ratio:>13.1f}%" for name, processed, ratio in rows]
    degree, prefix = summary["sharing_degree"], summary["prefix_num_tokens"]
    lines += [
        "",
        f"groups                   {summary['groups']} ({summary['shared_groups']} shared, "
        f"{summary['singletons']} singletons)",
        f"sharing degree           min {degree['min']:.0f}  mean {degree['mean']:.2f}  p50 {degree['p50']:.0f}"
        f"  p90 {degree['p90']:.0f}  max {degree['max']:.0f}",
        f"prefix tokens            min {prefix['min']:.0f}  mean {prefix['mean']:.1f}  p50 {prefix['p50']:.0f}"
        f"  p90 {prefix['p90']:.0f}  max {prefix['max']:.0f}",
        f"planning seconds         {summary['seconds']:.3f}",
    ]
    return "\n".join(lines)


def analyze_command(args) -> int:
    from batchllm.prefix import plan_prefix_arrays, plan_prefix_groups, write_groups_jsonl

    try:
        custom_ids, prompts, errors = _read_token_ids(args.input, args.model)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for message in errors:
        print(f"error: {message}", file=sys.stderr)
    prompts = prompts.views()  # int32 views into one flat buffer
    try:
        if args.groups:
            plan = plan_prefix_groups(prompts)
            with open(args.groups, "w", encoding="utf-8") as stream:
                write_groups_jsonl(plan, custom_ids, stream)
        else:
            plan = plan_prefix_arrays(prompts)
    except (ValueError, OSError) as error:  # PromptError, PrefixTreeTooDeepError, file errors
        print(f"error: {error}", file=sys.stderr)
        return 2
    summary = _summary(plan.stats, len(errors))
    if args.json:
        print(json.dumps(summary))
    else:
        print(_table(summary))
    return 1 if errors else 0
