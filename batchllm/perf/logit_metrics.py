"""How far one model's next-token distributions are from a reference's over the same text:
perplexity ratio, mean KL divergence, greedy top-1 agreement.

Row i of a logits tensor [num_tokens, vocab] predicts token i + 1, so every metric averages over
the num_tokens - 1 rows that have a next token (the last row is left out)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

ROWS_PER_BLOCK = 256  # rows taken at a time in float64 (a 128k vocabulary: 256 MiB a tensor)


@dataclass(frozen=True)
class NextTokenMetrics:
    reference_perplexity: float
    perplexity: float
    kl: float  # mean over rows of KL(p_reference || p_candidate), in nats
    top1_agreement: float  # fraction of rows whose argmax is the same

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity / self.reference_perplexity


def _targets(logits: torch.Tensor, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    targets = torch.as_tensor(token_ids, dtype=torch.long, device=logits.device)
    if logits.dim() != 2 or targets.dim() != 1 or logits.shape[0] != targets.shape[0]:
        raise ValueError(f"expected logits [num_tokens, vocab] and num_tokens token ids, got logits "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)} ids")
    if targets.shape[0] < 2:
        raise ValueError("need at least 2 tokens (one next-token prediction)")
    return targets[1:]


def perplexity(logits: torch.Tensor, token_ids: Sequence[int] | torch.Tensor) -> float:
    """exp of the mean negative log-likelihood of token i + 1 under row i."""
    targets = _targets(logits, token_ids)
    total_nll = 0.0
    num_rows = targets.shape[0]
    for start in range(0, num_rows, ROWS_PER_BLOCK):
        rows = slice(start, min(start + ROWS_PER_BLOCK, num_rows))
        log_probs = torch.log_softmax(logits[rows].double(), dim=-1)
        total_nll -= float(log_probs.gather(1, targets[rows, None]).sum())
    return math.exp(total_nll / num_rows)


def compare_next_token(reference_logits: torch.Tensor, candidate_logits: torch.Tensor,
                       token_ids: Sequence[int] | torch.Tensor) -> NextTokenMetrics:
    """Both models' logits [num_tokens, vocab] over the same token_ids."""
    if reference_logits.shape != candidate_logits.shape:
        raise ValueError(f"logits shapes differ: {tuple(reference_logits.shape)} vs {tuple(candidate_logits.shape)}")
    targets = _targets(reference_logits, token_ids)
    num_rows = targets.shape[0]
    candidate_logits = candidate_logits.to(reference_logits.device)
    total_kl, num_agree = 0.0, 0
    for start in range(0, num_rows, ROWS_PER_BLOCK):
        rows = slice(start, min(start + ROWS_PER_BLOCK, num_rows))
        reference = torch.log_softmax(reference_logits[rows].double(), dim=-1)
        candidate = torch.log_softmax(candidate_logits[rows].double(), dim=-1)
        probs = reference.exp()
        # a zero-probability token adds nothing (also where both log-probs are -inf)
        total_kl += float(torch.where(probs > 0, probs * (reference - candidate), 0.0).sum())
        num_agree += int((reference.argmax(dim=-1) == candidate.argmax(dim=-1)).sum())
    return NextTokenMetrics(
        reference_perplexity=perplexity(reference_logits, token_ids),
        perplexity=perplexity(candidate_logits, token_ids),
        kl=total_kl / num_rows,
        top1_agreement=num_agree / num_rows,
    )
