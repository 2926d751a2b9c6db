"""The paged attentions of triton_attention.py in plain torch: what their kernels must give, written to
be read rather than fast (tests/engine/test_triton_attention.py compares them, and so does a GPU
check). Same signatures and semantics:

    paged_decode_attention(q, cache, block_tables, context_lens, scale, window=0, *, own_k, own_v,
                           kv_splits)    kv_splits is accepted and ignored (it changes no value)
    paged_prefill_attention(q, cache, block_table, start, scale, window=0, *, own_k, own_v)

Each row's keys are gathered through its block table and read with format_of(cache.dtype)
.load_rotated() (the rows' basis, as the model attends); a query's own position takes own_k/own_v
where given (int8's own row rule, own_rows.py); the window keeps keys p - window < j <= p; scores and
softmax are float32, and a query with no key (a decode row of context 0) gives 0.
"""

from __future__ import annotations

import torch

from pdserve.engine.kv_format import format_of


def _gather_rows(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """[2, length, KVH, D] float32: a sequence's first length K and V rows, in order."""
    blocks = -(-length // cache.shape[2])
    rows = cache.index_select(1, table[:blocks].long()).flatten(1, 2)[:, :length]
    return format_of(cache.dtype).load_rotated(rows)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q [Tq, H, D], keys/values [Tk, KVH, D], allowed [Tq, Tk] -> [Tq, H, D] float32; a query that
    may attend nothing gives 0."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    scores = scores.masked_fill(~allowed, -torch.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # NOTE: a row of only -inf gives NaN
    return torch.einsum("hqk,khd->qhd", weights, values)


def _window_mask(q_pos: torch.Tensor, key_pos: torch.Tensor, window: int, own: bool) -> torch.Tensor:
    """[Tq, Tk]: causal (strictly, when a query's own row is attended apart), within the window."""
    allowed = key_pos[None, :] < q_pos[:, None] if own else key_pos[None, :] <= q_pos[:, None]
    if window:
        allowed &= key_pos[None, :] > q_pos[:, None] - window
    return allowed


def paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int = 0, *,
                           own_k: torch.Tensor | None = None, own_v: torch.Tensor | None = None,
                           kv_splits: int | None = None) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        keys, values = _gather_rows(cache, block_tables[b], length)
        if own_k is not None:
            keys[length - 1], values[length - 1] = own_k[b], own_v[b]
        q_pos = torch.tensor([length - 1], device=q.device)
        allowed = _window_mask(q_pos, torch.arange(length, device=q.device), window, own=False)
        out[b] = _attend(q[b:b + 1], keys, values, allowed, scale)[0]
    return out.to(q.dtype)


def paged_prefill_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, start: int,
                            scale: float, window: int = 0, *, own_k: torch.Tensor | None = None,
                            own_v: torch.Tensor | None = None) -> torch.Tensor:
    tokens = q.shape[0]
    keys, values = _gather_rows(cache, block_table, start + tokens)
    q_pos = torch.arange(start, start + tokens, device=q.device)
    allowed = _window_mask(q_pos, torch.arange(start + tokens, device=q.device), window, own_k is not None)
    if own_k is not None:  # each query's own row after the stored ones, seen by that query only
        keys, values = torch.cat((keys, own_k.float())), torch.cat((values, own_v.float()))
        allowed = torch.cat((allowed, torch.eye(tokens, dtype=torch.bool, device=q.device)), dim=1)
    return _attend(q, keys, values, allowed, scale).to(q.dtype)
