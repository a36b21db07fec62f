"""How long a finished request takes to reach the driver under Ray data parallelism.

Requests with staggered max_tokens (8, 12, 16, ...) run on Ray replicas of a small random model
on CPU; for every update the driver receives, the delay is its arrival time minus the end of
the replica's step that finished the request (ShardUpdate.finished_at_s). Prints the median, p90
and maximum delay, and how many separate updates the results came in.

    PYTHONPATH=. python3 benchmarks/ray_stream_delay.py
    PYTHONPATH=. python3 benchmarks/ray_stream_delay.py --num-requests 128 --num-replicas 2 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from batchllm.config import EngineConfig, RayDPConfig, engine_config
from batchllm.distributed.ray_dp import kill_replicas, plan_shards, start_replicas, stream_shards
from batchllm.engine.request_state import PreparedRequest
from batchllm.sampling_params import SamplingParams


def measure(config: EngineConfig, dp: RayDPConfig, num_requests: int) -> tuple[list[float], int]:
    """(delay in seconds of every request, number of updates that carried results)."""
    rng = np.random.default_rng(0)
    requests = [PreparedRequest(i, rng.integers(3, 500, 32).tolist(),
                                SamplingParams(max_tokens=8 + 4 * i, temperature=0.0, ignore_eos=True))
                for i in range(num_requests)]
    replicas = start_replicas(config, dp)
    delays, num_updates = [], 0
    try:
        for update in stream_shards(replicas, plan_shards(requests, dp), dp.stop_poll_s):
            if update.finished:
                num_updates += 1
                delays += [time.time() - update.finished_at_s] * len(update.finished)
    finally:
        kill_replicas(replicas)
    return delays, num_updates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-replicas", type=int, default=2)
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=args.num_replicas, include_dashboard=False, log_to_driver=False, configure_logging=False)
    config = engine_config(args.model, dtype="float32", device="cpu", kv_cache_tokens=16384)
    dp = RayDPConfig(num_replicas=args.num_replicas)
    for _ in range(args.repeats):
        delays, num_updates = measure(config, dp, args.num_requests)
        p90 = statistics.quantiles(delays, n=10)[8]
        print(f"{len(delays)} requests in {num_updates} updates; finish -> driver delay: median "
              f"{statistics.median(delays) * 1e3:.1f} ms, p90 {p90 * 1e3:.1f} ms, max {max(delays) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
