"""The FP8 linear layer of the decoder (e4m3 weights and activations, model-dtype output)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from batchllm.ops.fp8 import (FP8_DTYPE, QuantizedActivation, SkinnyConfig, SkinnyWorkspace, fp8_linear,
                              quantize_rows_reference, quantize_weight_rows, skinny_config)


class Fp8Linear(nn.Module):
    """y = x @ W.T + b with W stored in e4m3 and one float32 scale per output channel.

    The input arrives either already quantized (a QuantizedActivation from the fused RMSNorm or
    SwiGLU kernel) or in the model dtype, which is quantized per token here (static: with the
    checkpoint's per-tensor `input_scale`). The output is in `out_dtype`, the model dtype.

    On a GPU, inputs of up to 128 rows go through the skinny GEMM (ops/fp8_skinny.py) where
    ops/fp8.skinny_config says it beats cuBLASLt; `workspace` holds its split-K buffers and may be
    shared by every layer of a model.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, out_dtype: torch.dtype,
                 static_input_scale: bool = False, workspace: SkinnyWorkspace | None = None) -> None:
        super().__init__()
        self.workspace = workspace if workspace is not None else SkinnyWorkspace()
        self._num_sms: int | None = None
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, out_dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        # Static activations: one float32 scale for every row (a checkpoint's input_scale).
        self.input_scale = (nn.Parameter(torch.empty((), dtype=torch.float32), requires_grad=False)
                            if static_input_scale else None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=out_dtype), requires_grad=False) if bias else None

    def quantize_input(self, x: Tensor) -> QuantizedActivation:
        if x.is_cuda:
            from batchllm.ops.fp8_kernels import quantize_rows

            return quantize_rows(x.contiguous(), self.input_scale)
        return quantize_rows_reference(x, self.input_scale)

    def forward(self, x: Tensor | QuantizedActivation) -> Tensor:
        if not isinstance(x, QuantizedActivation):
            x = self.quantize_input(x)
        config = self.skinny_config(x.values.shape[0]) if x.values.is_cuda else None
        if config is not None:
            from batchllm.ops.fp8_skinny import skinny_fp8_linear

            return skinny_fp8_linear(x, self.weight, self.weight_scale, self.bias, self.out_dtype, config,
                                     self.workspace)
        return fp8_linear(x, self.weight, self.weight_scale, self.bias, self.out_dtype)

    def skinny_config(self, num_rows: int) -> SkinnyConfig | None:
        """The skinny GEMM's tiles for num_rows rows on this layer's GPU (None: cuBLASLt)."""
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(self.weight.device).multi_processor_count
        return skinny_config(num_rows, self.out_features, self.in_features, self._num_sms)

    @torch.no_grad()
    def load_rows_(self, rows: Tensor, row_start: int) -> None:
        """Quantize model-precision weight rows [n, in_features] into rows row_start.. (per-output
        -channel scales make each row independent, so fused layers load part by part)."""
        values, scales = quantize_weight_rows(rows.to(self.weight.device, self.out_dtype))
        self.weight.data[row_start:row_start + rows.shape[0]].copy_(values)
        self.weight_scale.data[row_start:row_start + rows.shape[0]].copy_(scales)

    def dequantized_weight(self) -> Tensor:
        """[out_features, in_features] float32 (for tests and debugging)."""
        return self.weight.float() * self.weight_scale[:, None]

    def extra_repr(self) -> str:
        static = "static" if self.input_scale is not None else "dynamic per-token"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, {static} activations"


def fp8_linear_from(linear: nn.Linear, out_dtype: torch.dtype, static_input_scale: bool,
                    workspace: SkinnyWorkspace | None = None) -> Fp8Linear:
    """An Fp8Linear of the same shape, on the same device as `linear` (meta stays meta)."""
    with torch.device(linear.weight.device):
        return Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None, out_dtype,
                         static_input_scale, workspace)


FP8_LINEAR_NAMES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def use_fp8_linears_(layers: nn.ModuleList, out_dtype: torch.dtype, static_input_scale: bool = False) -> None:
    """Replace the four linear layers of every decoder layer by Fp8Linear (weights unfilled), all
    sharing one skinny-GEMM workspace (their calls run in stream order)."""
    workspace = SkinnyWorkspace()
    for layer in layers:
        for name in FP8_LINEAR_NAMES:
            parent_name, _, child = name.partition(".")
            parent = getattr(layer, parent_name)
            setattr(parent, child, fp8_linear_from(getattr(parent, child), out_dtype, static_input_scale, workspace))


MIN_FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first NVIDIA GPUs with e4m3 tensor cores
FP8_REQUIREMENT = "needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper)"


def _fp8_device_problem(device: torch.device | str) -> str | None:
    """What `device` is, when FP8 cannot run there (None when it can)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"device {device.type!r}"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_FP8_CAPABILITY:
        return f"a GPU of compute capability {capability[0]}.{capability[1]}"
    return None


def fp8_unsupported_reason(device: torch.device | str) -> str | None:
    """Why FP8 cannot run on `device` (a sentence), or None when it can."""
    problem = _fp8_device_problem(device)
    return None if problem is None else f"FP8 {FP8_REQUIREMENT}; this run has {problem}"


def require_fp8_device(device: torch.device, what: str, instead: str) -> None:
    """Raise a clear error where FP8 cannot run; `what` names the flag or the checkpoint, `instead`
    what works there."""
    problem = _fp8_device_problem(device)
    if problem is not None:
        raise ValueError(f"{what} {FP8_REQUIREMENT}; this run has {problem}. {instead}")
