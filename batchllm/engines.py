"""The one place that builds engines, every kind: an LLMEngine on one device, a TPEngine for
tensor parallelism (config.parallel.tensor.size > 1), a RayEngine for data parallelism on Ray
(config.parallel.ray). `batchllm run`, `LLM(...)` and the bench all build theirs here."""

from __future__ import annotations

import signal

from batchllm.config import EngineConfig
from batchllm.distributed.ray_dp import RAY_MISSING
from batchllm.engine.engine_protocol import Engine
from batchllm.engine.errors import EngineConfigError
from batchllm.engine.host_check import check_host
from batchllm.engine.llm_engine import LLMEngine


class EngineStartError(RuntimeError):
    """The engine's workers or replicas could not start; the message says why."""


def build_engine(config: EngineConfig) -> Engine:
    """The engine config asks for, after checking that this host can run it (check_host:
    EngineConfigError naming the fix, before anything loads). A TPEngine or RayEngine holds
    processes: call its shutdown() when done (exit does it too)."""
    check_host(config)
    if config.parallel.ray is not None:
        return _ray_engine(config)
    if config.parallel.tensor.size > 1:
        from batchllm.distributed.tp_engine import TPEngine

        return TPEngine(config)
    return LLMEngine(config)


def _ray_engine(config: EngineConfig) -> Engine:
    """Replicas on the Ray cluster of RAY_ADDRESS, else a local one."""
    try:
        import ray
    except ImportError:
        raise EngineConfigError(RAY_MISSING) from None
    from batchllm.distributed.ray_engine import RayEngine

    handler = signal.getsignal(signal.SIGTERM)
    ray.init(ignore_reinit_error=True, configure_logging=False)
    signal.signal(signal.SIGTERM, handler)  # ray.init's handler exits at once; a batch job saves first
    try:
        return RayEngine(config)
    except ray.exceptions.RayError as error:
        raise EngineStartError(f"a Ray replica could not load the model: {error}") from None
