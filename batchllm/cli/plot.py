"""`batchllm plot`: tokens-per-iteration timelines from step traces (BatchLLM Fig. 2 / Fig. 9)."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="draw tokens-per-iteration timelines from step traces (one panel per trace)",
        description=(
            "Draw, for each TRACE.json written by `batchllm simulate --trace OUT.json` or\n"
            "`batchllm bench --trace-dir DIR`, the tokens of every iteration stacked by kind (decode /\n"
            "distinct prompt / common prefix), with the token budget and the valley line (half the\n"
            "budget), like the paper's Fig. 2 / 9; one panel per trace, into one PNG. Needs matplotlib\n"
            "(pip install matplotlib).\n\n"
            "Example:\n"
            "  batchllm simulate examples/batch.jsonl --trace steps.json\n"
            "  batchllm plot steps.json -o steps.png"
        ),
    )
    parser.add_argument("traces", metavar="TRACE.json", nargs="+")
    parser.add_argument("-o", "--output", metavar="PNG", required=True)
    parser.add_argument("--title", default=None)
    parser.set_defaults(func=plot_command)


def plot_command(args: argparse.Namespace) -> int:
    import importlib.util

    from batchllm.perf.plot import plot_timelines
    from batchllm.sched.trace import read_trace

    if importlib.util.find_spec("matplotlib") is None:
        print("batchllm plot: error: it draws with matplotlib, which is not installed (fix: pip install matplotlib)",
              file=sys.stderr)
        return 2

    try:
        traces = [read_trace(path) for path in args.traces]
    except (OSError, ValueError) as error:
        print(f"batchllm plot: error: {error}", file=sys.stderr)
        return 2
    plot_timelines(traces, args.output, args.title)
    print(f"wrote {args.output}")
    return 0
