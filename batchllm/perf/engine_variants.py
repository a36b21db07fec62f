"""The engine variants one `batchllm bench` run measures: its --quantization and --kv-cache-dtype
lists, every combination, one engine each. Torch-free."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

NO_QUANTIZATION = "none"  # how the command line spells EngineConfig.quantization None
QUANTIZATION_CHOICES = (NO_QUANTIZATION, "fp8")
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8")


@dataclass(frozen=True)
class EngineVariant:
    quantization: str | None = None  # EngineConfig.quantization
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype

    @property
    def uses_fp8(self) -> bool:
        return self.quantization == "fp8" or self.kv_cache_dtype == "fp8"

    @property
    def label(self) -> str:
        return f"quantization {self.quantization or NO_QUANTIZATION}, KV cache {self.kv_cache_dtype}"


def _choices(text: str, option: str, choices: tuple[str, ...]) -> list[str]:
    values = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))  # in order, once
    if not values:
        raise ValueError(f"{option} is empty: give one of {', '.join(choices)} or a comma list of them")
    for value in values:
        if value not in choices:
            raise ValueError(f"unknown value {value!r} in {option} {text!r}: one of {', '.join(choices)} "
                             f"or a comma list of them (e.g. {','.join(choices)})")
    return values


def parse_variants(quantization: str = NO_QUANTIZATION, kv_cache_dtype: str = "auto") -> tuple[EngineVariant, ...]:
    """'none,fp8' x 'auto' -> (bf16 engine, FP8 engine); every combination, quantization first."""
    quantizations = _choices(quantization, "--quantization", QUANTIZATION_CHOICES)
    kv_cache_dtypes = _choices(kv_cache_dtype, "--kv-cache-dtype", KV_CACHE_DTYPE_CHOICES)
    return tuple(EngineVariant(None if q == NO_QUANTIZATION else q, kv)
                 for q, kv in itertools.product(quantizations, kv_cache_dtypes))
