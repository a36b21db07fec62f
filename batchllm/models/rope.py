"""Rotary position embedding (rotate-half convention, as HF transformers' Llama).

The cos/sin table is float32 and grows on demand; rotation runs in float32 and the result is
cast back to the input dtype.
"""

from __future__ import annotations

import math

import torch

from batchllm.models.config import ModelArchConfig


def rope_inverse_frequencies(config: ModelArchConfig) -> torch.Tensor:
    """Per-pair angular frequency (radians per position), float32 [head_dim // 2]."""
    head_dim = config.head_dim
    # explicit CPU: the model may be built under a torch.device("meta") context
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, scaling)
    if rope_type == "freq_factors":
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float32, device="cpu")
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope freq_factors has shape {tuple(factors.shape)}, expected {tuple(inv_freq.shape)}")
        return inv_freq / factors
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported (default, linear, llama3, freq_factors)")


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Same formula as transformers' _compute_llama3_parameters: long wavelengths are divided by
    # `factor`, short ones kept, the band between interpolated smoothly.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


class RotaryEmbedding:
    """Holds the float32 cos/sin table; not an nn.Module so `model.to(dtype)` never touches it."""

    def __init__(self, config: ModelArchConfig):
        self.inv_freq = rope_inverse_frequencies(config)  # [head_dim // 2] float32, CPU
        self.initial_positions = config.max_position_embeddings
        self.cos: torch.Tensor | None = None  # [cached_positions, head_dim] float32
        self.sin: torch.Tensor | None = None

    def ensure_capacity(self, num_positions: int, device: torch.device) -> None:
        """Grow (at least doubling) the table to cover positions [0, num_positions) on `device`."""
        cached_positions = 0 if self.cos is None else self.cos.shape[0]
        if self.cos is not None and self.cos.device == device and cached_positions >= num_positions:
            return
        size = max(num_positions, self.initial_positions, 2 * cached_positions)
        inv_freq = self.inv_freq.to(device)
        positions = torch.arange(size, device=device, dtype=torch.int64).to(torch.float32)
        angles = torch.outer(positions, inv_freq)  # [size, head_dim // 2]
        angles = torch.cat((angles, angles), dim=-1)  # [size, head_dim]
        self.cos = angles.cos()
        self.sin = angles.sin()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> cos, sin: [T, 1, head_dim] float32 (broadcast over heads).

        The first call builds the table for max_position_embeddings positions on the positions'
        device. Beyond that the table grows on demand, checked only on CPU: on CUDA the check
        would sync every step, so a caller that needs longer positions calls ensure_capacity.
        """
        if self.cos is None or self.cos.device != positions.device:
            self.ensure_capacity(self.initial_positions, positions.device)
        if positions.device.type == "cpu" and positions.numel() > 0:
            self.ensure_capacity(int(positions.max()) + 1, positions.device)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim] float32 -> rotate-half RoPE in x.dtype."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)
