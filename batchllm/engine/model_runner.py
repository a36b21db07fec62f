"""Turns a SchedulerOutput into tensors, runs the model, samples the next tokens."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Literal, cast

import torch

from batchllm.engine.attention.paged import PagedAttention
from batchllm.engine.attention.protocol import AttentionMetadata, GraphAttentionBackend
from batchllm.engine.attention.select import AttentionShape, select_backend
from batchllm.engine.batch_rows import BatchRows
from batchllm.engine.cuda_graphs import DecodeGraphRunner
from batchllm.engine.graph_capture import GraphCapture
from batchllm.engine.graph_shapes import decode_rows_bucket, piecewise_buckets
from batchllm.engine.kv_cache import KVCache
from batchllm.engine.last_tokens import FedRows, LastTokenColumn
from batchllm.engine.penalties import PenaltyTable
from batchllm.engine.piecewise_graphs import PiecewiseGraphs
from batchllm.engine.prompt_logprobs import PromptLogprobRows, compute_prompt_logprobs
from batchllm.engine.sampler import SamplingBatch, StepConstraint, sample
from batchllm.engine.sampling_rows import SamplingRows
from batchllm.engine.step_buffers import ActivationShape, StepBuffers
from batchllm.engine.step_inputs import StepInputs, build_step_inputs
from batchllm.engine.step_observer import StepObserver
from batchllm.engine.step_result import SampledHostCopies, StepResult
from batchllm.models.config import ModelArchConfig
from batchllm.ops.transfer import PinnedStaging
from batchllm.sched.interface import SchedulerOutput

# How a step's forward ran: a whole-step CUDA graph, piecewise graphs (or their uncaptured pieces
# on the CPU) with eager attention between them, or op by op.
StepMode = Literal["graph_replay", "piecewise", "eager"]


def graph_capacity(max_num_tokens: int) -> int:
    """Rows of the step buffers for steps of up to max_num_tokens tokens: the largest piecewise
    bucket, or the rows of the largest decode graph such a step can use."""
    return max(max_num_tokens, decode_rows_bucket(max_num_tokens) or 0)


class ModelRunner:
    """The StepRunner of one device (engine/step_runner.py).

    cuda_graphs (a CUDA device and a backend whose store and attention graphs can capture): decode
    steps replay whole-step graphs captured on first use, other steps of up to max_num_tokens
    tokens replay the piecewise graphs captured here, at start-up; anything else runs eagerly.
    piecewise_on_cpu: run steps through the uncaptured pieces and the same buffers on a CPU (tests
    compare them with the plain forward)."""

    def __init__(self, model: torch.nn.Module, arch: ModelArchConfig, kv_cache: KVCache, block_size: int,
                 device: torch.device, attention_backend: str, cuda_graphs: bool = True, max_num_tokens: int = 2048,
                 piecewise_on_cpu: bool = False) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        selected = select_backend(attention_backend, device, AttentionShape(
            block_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, tuple(arch.layer_windows), kv_cache.k.dtype,
            model.embed_tokens.weight.dtype))
        self.backend, self.attention_backend = selected.backend, selected.name  # the name "auto" became
        self.scale = arch.head_dim ** -0.5
        self.rows = BatchRows()  # the persistent batch: host rows kept from step to step
        self.last_tokens = LastTokenColumn(device, self.rows.num_rows)  # each row's last sampled id
        self.staging = PinnedStaging(device)  # every host-to-device copy of a step
        self.penalty_table = PenaltyTable(device)  # penalised requests' token counts (allocated on first use)
        self.host_copies = SampledHostCopies() if device.type == "cuda" else None
        self.activation_shape = ActivationShape(model.config.hidden_size, model.config.num_heads,
                                                model.config.head_dim, model.embed_tokens.weight.dtype)
        self.use_cuda_graphs = (cuda_graphs and device.type == "cuda" and self.backend.supports_cuda_graphs)
        self.piecewise_on_cpu = piecewise_on_cpu and device.type == "cpu"
        self.capture: GraphCapture | None = None
        self.graphs: DecodeGraphRunner | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self.max_num_tokens = max_num_tokens  # the largest step the buffers and graphs are built for
        self.capture_graphs(max_num_tokens)
        # A profiler's hook around every execute (StepObserver); None: no cost but this check.
        self.observer: StepObserver | None = None
        self.last_mode: StepMode = "eager"
        # Steps by how they ran and graph replays, since the runner was built (graph_counts).
        self._counts = dict.fromkeys(("graph_replays", "piecewise_steps", "piece_replays", "eager_steps"), 0)

    # -- graphs ------------------------------------------------------------------------------

    def capture_graphs(self, max_num_tokens: int | None = None) -> None:
        """(Re)build the step buffers for steps of up to max_num_tokens tokens (None: the current
        size) and capture the piecewise graphs for them; the decode graphs are captured again on
        their first use. Call it again after replacing the KV cache: graphs capture its tensors."""
        max_num_tokens = self.max_num_tokens = max_num_tokens or self.max_num_tokens
        self.release_graphs()
        graphed = self.use_cuda_graphs or self.piecewise_on_cpu
        capacity = graph_capacity(max_num_tokens) if graphed else max_num_tokens
        self.buffers = StepBuffers(capacity, self.activation_shape, self.device, activations=graphed)
        if not graphed:
            return
        if self.use_cuda_graphs:
            # A new pool: the released graphs' pool is freed once its last graph is gone.
            self.capture = GraphCapture(self.device)
        self.piecewise = PiecewiseGraphs(self.model, self.kv_cache, self.backend, self.scale, self.buffers,
                                         self.staging, piecewise_buckets(max_num_tokens), self.capture)
        if self.use_cuda_graphs:
            graph_backend = cast(GraphAttentionBackend, self.backend)  # what supports_cuda_graphs declares
            self.graphs = DecodeGraphRunner(self.model, self.kv_cache, graph_backend, self.scale, self.buffers,
                                            self.staging, self.capture)
            with torch.inference_mode():
                self.piecewise.capture_all()
            torch.cuda.synchronize(self.device)
            # The warm-ups' activations were cached for the capture stream: give them back to the
            # device, where the eager work on the step's stream can use them.
            torch.cuda.empty_cache()

    def ensure_step_capacity(self, max_num_tokens: int) -> None:
        """Graphs for steps of up to max_num_tokens tokens: captured again, larger, when a run's
        token budget exceeds what they were captured for (before the run's first step)."""
        if self.piecewise is not None and max_num_tokens > self.max_num_tokens:
            self.capture_graphs(max_num_tokens)

    def release_graphs(self) -> None:
        """Destroy the captured graphs, after the device has finished replaying them. A graph that
        captured NCCL collectives keeps the communicator busy: tearing the process group down before
        its graphs are gone hangs."""
        if self.graphs is None and self.piecewise is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for graphs in (self.graphs, self.piecewise):
            if graphs is not None:
                graphs.release()
        self.graphs = self.piecewise = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the pool's memory, now that no graph holds it

    def graph_counts(self) -> dict[str, int]:
        """Steps by how they ran and graph replays since the runner was built (the bench's row
        fields): graph_replays (whole-step graphs), piecewise_steps and their piece_replays (none
        for uncaptured pieces on the CPU), eager_steps."""
        return dict(self._counts)

    # -- steps -------------------------------------------------------------------------------

    def execute(self, output: SchedulerOutput, sampling_rows: SamplingRows, allow_graph: bool = True,
                constraint: StepConstraint | None = None,
                prompt_logprobs: PromptLogprobRows | None = None) -> StepResult:
        """sampling_rows: the sampled chunks' settings as columns, in chunk order.
        allow_graph: False runs the step eagerly even when CUDA graphs could run it.
        constraint: gives the token bitmask of the structured-output rows, asked for after the forward is queued.
        prompt_logprobs: the prompt rows to score (an extra LM-head call on those rows only)."""
        observer = self.observer
        if observer is None:
            return self._execute(output, sampling_rows, allow_graph, constraint, prompt_logprobs)
        observer.step_started(output)
        self.last_mode = "eager"
        try:
            return self._execute(output, sampling_rows, allow_graph, constraint, prompt_logprobs)
        finally:
            observer.step_launched(output, self.last_mode)

    @torch.inference_mode()
    def _execute(self, output: SchedulerOutput, sampling_rows: SamplingRows, allow_graph: bool,
                 constraint: StepConstraint | None = None,
                 prompt_logprobs: PromptLogprobRows | None = None) -> StepResult:
        self.staging.begin_step()
        inputs = self.step_inputs(output)
        prompt_rows = None
        if prompt_logprobs is not None:
            prompt_rows = self.staging.upload({"rows": prompt_logprobs.rows, "target_ids": prompt_logprobs.target_ids})
        if not sampling_rows:  # (then no row is fed either: a decode row samples)
            hidden = self._forward(inputs, allow_graph)
            return StepResult((), None, prompt_logprobs=self._prompt_logprobs(hidden, prompt_rows, prompt_logprobs))
        # Sampling settings and row indices go to the device before the forward is queued (no
        # wait behind it).
        batch = SamplingBatch.build(sampling_rows, self.device, self.staging.upload)
        indices = self.staging.upload({name: getattr(inputs, name) for name in _ROW_INDICES})
        hidden = self._forward(inputs, allow_graph, _fed_rows(inputs, indices))
        scored = self._prompt_logprobs(hidden, prompt_rows, prompt_logprobs)
        # Only the rows that sample (and the prompt rows asked for, above) pay for the LM head.
        logits = self.model.compute_logits(hidden[indices["sample_rows"]], float32=False)
        bitmask = constraint.token_bitmask(logits.shape[-1], self.staging) if constraint is not None else None
        sampled = sample(logits, batch, bitmask, self.penalty_table)
        self.last_tokens.store(indices["sample_batch_rows"], sampled.token_ids)
        host = self.host_copies.copy(sampled) if self.host_copies is not None else None
        return StepResult(inputs.sample_seq_ids, sampled, host, prompt_logprobs=scored)

    def _prompt_logprobs(self, hidden: torch.Tensor, device_rows: dict[str, torch.Tensor] | None,
                         asked: PromptLogprobRows | None):
        if device_rows is None:
            return None
        return compute_prompt_logprobs(self.model.compute_logits, hidden, device_rows["rows"],
                                       device_rows["target_ids"], asked.num_top)

    def step_inputs(self, output: SchedulerOutput) -> StepInputs:
        """The step's host arrays, from the persistent rows."""
        inputs = build_step_inputs(output, self.block_size, self.rows.step_rows(output))
        self.last_tokens.fit(self.rows.num_rows)
        return inputs

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, allow_graph: bool = True) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of one step (a step of its own: tests and tools). With
        graphs they are a view of the runner's buffers, valid until the next step."""
        self.staging.begin_step()
        return self._forward(inputs, allow_graph)

    def _forward(self, inputs: StepInputs, allow_graph: bool = True, fed: FedRows | None = None) -> torch.Tensor:
        """A decode step replays its whole-step graph, another step its piecewise graphs, and a step
        that fits neither (or allow_graph False) runs eagerly.
        fed: the step's rows fed from the last-token column, on the device (None: uploaded here)."""
        if fed is None and inputs.fed_rows.size:
            fed = _fed_rows(inputs, self.staging.upload({name: getattr(inputs, name) for name in _FED}))
        feed = partial(self.last_tokens.feed, fed=fed)
        host_plan = self.backend.build_plan(inputs)
        counts = self._counts
        if allow_graph:
            if self.graphs is not None:
                hidden = self.graphs.run(inputs, host_plan, feed)
                if hidden is not None:
                    self.last_mode = "graph_replay"
                    counts["graph_replays"] += 1
                    return hidden
            if self.piecewise is not None:
                hidden = self.piecewise.run(inputs, host_plan, feed)
                if hidden is not None:
                    self.last_mode = "piecewise"
                    counts["piecewise_steps"] += 1
                    counts["piece_replays"] += self.model.num_pieces if self.capture is not None else 0
                    return hidden
        self.last_mode = "eager"
        counts["eager_steps"] += 1
        return self._forward_eager(inputs, host_plan, feed)

    def _forward_eager(self, inputs: StepInputs, host_plan, feed: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """host_plan: the backend's build_plan(inputs)."""
        if inputs.num_tokens <= self.buffers.capacity:
            input_ids, positions, slot_mapping = self.buffers.fill_tokens(self.staging, inputs, inputs.num_tokens)
        else:  # a step larger than the buffers: its arrays travel like the plan's
            device = self.staging.upload({name: getattr(inputs, name) for name in _TOKENS})
            input_ids, positions, slot_mapping = (device[name] for name in _TOKENS)
        feed(input_ids)
        metadata = AttentionMetadata(slot_mapping, positions,
                                     self.backend.plan_to_device(host_plan, self.device, self.staging.upload))
        attention = PagedAttention(self.kv_cache, metadata, self.backend, self.scale)
        return self.model(input_ids, positions, attention)


def _fed_rows(inputs: StepInputs, indices: dict[str, torch.Tensor]) -> FedRows | None:
    if not inputs.fed_rows.size:
        return None
    return FedRows(indices["fed_rows"], indices["fed_batch_rows"], inputs.fed_rows.size == inputs.num_tokens)


_TOKENS = ("input_ids", "positions", "slot_mapping")
_FED = ("fed_rows", "fed_batch_rows")
_ROW_INDICES = ("sample_rows", "sample_batch_rows", *_FED)
