"""Token sampling: greedy, temperature, top-k, top-p, with a per-request generator.

Greedy rows are one batched argmax. Random rows are sampled one at a time with
their own torch.Generator, so a request's output depends only on its seed and
its logits, never on which other requests shared the batch.
"""

from __future__ import annotations

import torch

from pdserve.engine.sequence import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> list[int]:
    """logits: [B, V] float32, one row per sequence; returns one token id per row."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            tokens[row] = sample_row(logits[row], p, gen)
    return tokens


def sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    probs = filtered_probs(logits, p)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Softmax of logits / temperature after top-k, then top-p (nucleus) filtering."""
    scaled = logits.float() / p.temperature
    if 0 < p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled.softmax(-1)
