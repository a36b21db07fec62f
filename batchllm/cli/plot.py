"""`batchllm plot`: tokens-per-iteration timelines from step traces (BatchLLM Fig. 2 / Fig. 9)."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="draw tokens-per-iteration timelines from step traces (one panel per trace)",
        description=(
            "Draw, for each TRACE.json written by `batchllm simulate --trace` or a run, the tokens\n"
            "of every iteration stacked by kind (decode / distinct prompt / common prefix), with\n"
            "the token budget and the valley line (half the budget), like the paper's Fig. 2 / 9."
        ),
    )
    parser.add_argument("traces", metavar="TRACE.json", nargs="+")
    parser.add_argument("-o", "--output", metavar="PNG", required=True)
    parser.add_argument("--title", default=None)
    parser.set_defaults(func=plot_command)


def plot_command(args: argparse.Namespace) -> int:
    from batchllm.perf.plot import plot_timelines
    from batchllm.sched.trace import read_trace

    try:
        traces = [read_trace(path) for path in args.traces]
    except (OSError, ValueError) as error:
        print(f"batchllm plot: error: {error}", file=sys.stderr)
        return 2
    plot_timelines(traces, args.output, args.title)
    print(f"wrote {args.output}")
    return 0
