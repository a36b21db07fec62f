"""The architecture description every loader produces and the model consumes."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelArchConfig:
    """Shape and numerics of a Llama-family decoder (Llama, Qwen2, Mistral).

    rope_scaling: None (plain RoPE) or a dict with "rope_type" in
      "linear"       {"factor"}
      "llama3"       {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
      "freq_factors" {"freq_factors": tuple of head_dim // 2 divisors} (llama.cpp's rope_freqs tensor)
    """

    architecture: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Sliding-window attention (Mistral, Qwen2 with use_sliding_window): a query at position p
    # sees KV positions in (p - sliding_window, p], as HF transformers masks them. None: full
    # attention. full_attention_layers: layers that attend fully anyway (Qwen2's layers below
    # max_window_layers).
    sliding_window: int | None = None
    full_attention_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        object.__setattr__(self, "eos_token_ids", tuple(dict.fromkeys(int(t) for t in self.eos_token_ids)))
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool) or self.sliding_window < 1
        ):
            raise ValueError(f"sliding_window must be None or an integer >= 1, got {self.sliding_window!r}")
        object.__setattr__(self, "full_attention_layers", tuple(int(i) for i in self.full_attention_layers))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """The sliding window of every layer (None: full attention); () when no layer has one."""
        if self.sliding_window is None:
            return ()
        full = set(self.full_attention_layers)
        return tuple(None if i in full else self.sliding_window for i in range(self.num_layers))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self, include_embeddings: bool = False) -> int:
        """Parameter count.

        include_embeddings=False gives the "non-embedding" count used for FLOP bounds
        (forward FLOPs per token ~ 2 * num_params()): it leaves out both the input embedding
        table (a lookup, no FLOPs) and the output projection (lm_head, vocab_size * hidden_size,
        whose FLOPs are paid only for rows whose logits are computed). include_embeddings=True
        gives the checkpoint's total (the lm_head counted once more when it is not tied).
        """
        hidden = self.hidden_size
        qkv_out = self.q_size + 2 * self.kv_size
        attention = hidden * qkv_out + (qkv_out if self.qkv_bias else 0) + self.q_size * hidden
        mlp = 3 * hidden * self.intermediate_size
        norms = 2 * hidden
        total = self.num_layers * (attention + mlp + norms) + hidden  # + final norm
        if include_embeddings:
            embedding = self.vocab_size * hidden
            total += embedding if self.tie_word_embeddings else 2 * embedding
        return total
