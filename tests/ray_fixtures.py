"""One local Ray cluster per test session, shared through pytest's plugin mechanism
(`pytest_plugins = ["ray_fixtures"]`): starting one costs seconds on a small machine.

    ray_address   the cluster's address (ray.init done; subprocesses join it with RAY_ADDRESS)

4 logical CPUs (the machine may have fewer: they only count what actors reserve), so a
2-replica job (1 CPU each, as the CLI asks) and a killed job's replicas being reclaimed fit.
Skips the test where Ray is not installed.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_address():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'batchllm[ray]')")
    ray.init(num_cpus=4, object_store_memory=100 * 2**20, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
