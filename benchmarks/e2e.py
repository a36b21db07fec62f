"""End-to-end throughput: several policies in ONE process on the same model, side by side.

    PYTHONPATH=. python benchmarks/e2e.py --model random:llama-3.1-8b --workload micro:2000:200:16 \
        --requests 512 --policies batchllm,vllm,sglang --out benchmarks/results/e2e.json

Outputs are forced to a fixed length (ignore_eos). Each policy runs after a warm-up batch (Triton
compilation excluded). Time / FLOP bound uses the optimal-sharing FLOPs (batchllm/bench/flop_bound.py).

Thin wrapper around `batchllm bench` (batchllm/bench/, batchllm/cli/bench.py): same options, plus
--input FILE and --markdown FILE; the table is also written next to --out as .md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from batchllm.bench.hf_peer import time_hf_generate  # noqa: E402,F401
from batchllm.bench.policies import parse_policy  # noqa: E402,F401
from batchllm.bench.runner import gpu_busy_seconds, save_trace  # noqa: E402,F401
from batchllm.bench.workload import make_workload  # noqa: E402,F401
from batchllm.cli.bench import DEFAULT_OUT, add_bench_arguments, bench_command  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(parser, default_out=DEFAULT_OUT)
    return bench_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
