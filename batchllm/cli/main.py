"""Entry point of the `batchllm` command.

Each sub-command lives in its own module `batchllm.cli.<name>` exposing
`add_parser(subparsers)`, which registers its arguments and sets `func` (args -> exit code).
Modules import their heavy dependencies inside `func`, so `batchllm analyze` on token ids and
`batchllm simulate` never import torch.
"""

from __future__ import annotations

import argparse
import functools
import sys

from batchllm import __version__
from batchllm.cli import analyze, bench, plot, run, simulate
from batchllm.cli.std_streams import pipe_safe_std_streams


def build_parser() -> argparse.ArgumentParser:
    # every description here is laid out by hand
    new_parser = functools.partial(argparse.ArgumentParser, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser = new_parser(
        prog="batchllm",
        description=(
            "Offline, throughput-oriented batched LLM inference with global prefix sharing.\n"
            "Feed it an OpenAI-Batch JSONL file; get one answer line per request."
        ),
        epilog="Run `batchllm COMMAND --help` for the options of one command.",
    )
    parser.add_argument("--version", action="version", version=f"batchllm {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=new_parser)
    for module in (run, analyze, simulate, plot, bench):
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    with pipe_safe_std_streams():  # a closed stdout or stderr does not crash a finished job
        try:
            return int(args.func(args) or 0)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
