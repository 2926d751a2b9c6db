"""Token sampling: greedy, temperature, top-k, top-p, with a per-request generator; and the
log-probabilities of what was sampled.

Greedy rows are one batched argmax. Random rows are sampled one at a time with
their own torch.Generator, so a request's output depends only on its seed and
its logits, never on which other requests shared the batch.

Logprobs (token_logprobs) are log_softmax of the same raw float32 rows sample() receives, before
temperature and the filters, for the rows whose request asked only.
"""

from __future__ import annotations

import torch

from pdserve.engine.sequence import SamplingParams, TokenLogprob


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


def token_logprobs(logits: torch.Tensor, tokens: list[int],
                   params: list[SamplingParams]) -> list[TokenLogprob | None]:
    """logits: the [B, V] rows sample() received; tokens: what it sampled from them. One
    TokenLogprob per row whose request asked (logprobs set), None for the others: only the asking
    rows are softmaxed, so a batch in which nobody asked pays nothing."""
    out: list[TokenLogprob | None] = [None] * len(params)
    asking = [row for row, p in enumerate(params) if p.logprobs is not None]
    if not asking:
        return out
    logprobs = torch.log_softmax(logits[asking].float(), dim=-1)
    for row, row_logprobs in zip(asking, logprobs, strict=True):
        token = tokens[row]
        out[row] = TokenLogprob(token, float(row_logprobs[token]),
                                top_logprobs(row_logprobs, params[row].logprobs))
    return out


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The k largest (token id, logprob) of one row, largest first, ties broken by the lower id.
    NOTE: torch.topk leaves the order of equal values unspecified, and which of several tokens tied
    at the k-th value it keeps; so every token that reaches the k-th value is gathered (k of them,
    but for ties) and ranked here."""
    k = min(k, logprobs.shape[-1])
    if k == 0:
        return ()
    kth = torch.topk(logprobs, k).values[-1]
    ids = torch.nonzero(logprobs >= kth).flatten()
    ranked = sorted(zip(ids.tolist(), logprobs[ids].tolist(), strict=True), key=lambda t: (-t[1], t[0]))
    return tuple(ranked[:k])
