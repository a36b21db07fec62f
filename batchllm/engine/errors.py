"""Errors of the engine as a whole (torch-free): a request's own errors are in request_limits."""


class EngineBrokenError(RuntimeError):
    """The engine cannot run any further request (a tensor-parallel step failed after its
    collectives had started, so the ranks disagree on what ran): rebuild it. A batch job stops
    on it, keeping its journal, instead of recording every request left as an error."""


class EngineConfigError(ValueError):
    """A configuration this host cannot run (no GPU for --device cuda, a KV cache larger than the
    memory, Triton kernels on a CPU): refused before the model or its cache loads; the message
    names the fix."""
