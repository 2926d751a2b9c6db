"""Attention where queries attend their own row unquantized (int8: KVFormat.own_row_in_float32).

The rule: the query at position p attends the stored rows of positions s < p, as the pool gives them
back, and its own token's K/V as the model computed them (float32, in the rows' basis). Its own
stored row is not attended. Two forms of it:

    with_own_rows          the rule itself, densely: the stored rows, then the chunk's own rows, and a
                           mask (earlier stored rows | the query's own row). DecoderModel's reference
                           uses it, and its prefill chunks off the CPU (a decode row instead writes
                           its own K/V over its stored copy in the gathered keys).
    attend_with_own_rows   a prefill chunk, fast: flash attention over the stored rows of s < p, which
                           gives each query's log-sum-exp, then the own row merged in by the softmax
                           sums. The dense form's mask doubles the keys and leaves SDPA's causal flash
                           path, so prefill chunks attended through it take far longer (a one-off
                           timing of the change's first version; docs/benchmarks.md's int8 KV rows
                           link the study that has it).

NOTE: merging by the softmax sums is exact arithmetic, so the two forms differ by float32 rounding
only (tests/engine/test_own_rows.py compares them).
"""

from __future__ import annotations

import torch

OwnRows = tuple[torch.Tensor, torch.Tensor]  # a query's own K and V, [T, KVH, D], float32, rows' basis


def own_rows_at(own: OwnRows | None, index: slice | torch.Tensor) -> OwnRows | None:
    """The own rows of some queries (None stays None: a format without own rows)."""
    return None if own is None else (own[0][index], own[1][index])


def with_own_rows(keys: torch.Tensor, values: torch.Tensor, own: OwnRows, start: int,
                  window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values and mask of a chunk whose queries attend their own row as computed.

    keys/values: [ctx, KVH, D], the stored rows of positions 0..ctx-1; own: the chunk's rows, at
    positions start..ctx-1. Returns [ctx + q_len, KVH, D] twice (stored rows, then own rows) and a
    [q_len, ctx + q_len] mask: query p sees stored rows s < p (and s > p - window, for a windowed
    layer) and its own row."""
    ctx, q_len = keys.shape[0], own[0].shape[0]
    q_pos = torch.arange(start, start + q_len, device=keys.device)[:, None]
    stored = torch.arange(ctx, device=keys.device)[None, :]
    earlier = stored < q_pos
    if window is not None:
        earlier &= stored > q_pos - window
    itself = torch.eye(q_len, dtype=torch.bool, device=keys.device)
    return (torch.cat((keys, own[0])), torch.cat((values, own[1])), torch.cat((earlier, itself), dim=1))


def attend_with_own_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, own: OwnRows,
                         start: int, scale: float) -> torch.Tensor:
    """q: [q_len, H, D] at positions start..; keys/values: [ctx, KVH, D] stored rows of positions
    0..ctx-1 (ctx = start + q_len); own: the chunk's own K/V. Returns [q_len, H, D]. CPU tensors
    only: the log-sum-exp comes from CPU flash attention (elsewhere DecoderModel attends by the mask)."""
    out, lse = _earlier_rows(q, keys, values, start, scale)  # [q_len, H, D], [q_len, H]
    q_len, heads, dim = q.shape
    kv_heads = own[0].shape[1]
    grouped = q.view(q_len, kv_heads, heads // kv_heads, dim)
    own_score = torch.einsum("tkgd,tkd->tkg", grouped, own[0]).reshape(q_len, heads) * scale
    top = torch.maximum(lse, own_score)
    earlier_weight, own_weight = (lse - top).exp(), (own_score - top).exp()
    own_v = own[1].repeat_interleave(heads // kv_heads, dim=1)  # [q_len, H, D]
    merged = out * earlier_weight[..., None] + own_v * own_weight[..., None]
    return merged / (earlier_weight + own_weight)[..., None]


def _earlier_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query at p over the stored rows s < p, and its log-sum-exp ([q_len, H]);
    a query with no earlier row (p = 0) gets output 0 and log-sum-exp -inf."""
    q_len, heads, dim = q.shape
    if start == 0:
        # NOTE: query p over keys 0..p-1 is causal attention of queries 1.. over keys ..q_len-2 (torch's
        # causal mask is aligned top-left: query i sees keys 0..i), which keeps SDPA's causal flash path.
        out, lse = _flash(q[1:], keys[:q_len - 1], values[:q_len - 1], None, True, scale)
        first = torch.zeros(1, heads, dim, dtype=q.dtype, device=q.device)
        no_rows = torch.full((1, heads), -torch.inf, dtype=q.dtype, device=q.device)
        return torch.cat((first, out)), torch.cat((no_rows, lse))
    ctx = keys.shape[0]
    q_pos = torch.arange(start, start + q_len, device=q.device)[:, None]
    earlier = torch.arange(ctx, device=q.device)[None, :] < q_pos  # every query has start >= 1 of them
    mask = torch.zeros(earlier.shape, dtype=q.dtype, device=q.device).masked_fill_(~earlier, -torch.inf)
    return _flash(q, keys, values, mask, False, scale)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention of one sequence ([T, heads, D] in and out, grouped KV heads allowed) and its
    log-sum-exp [Tq, H]: the op F.scaled_dot_product_attention runs on the CPU, which also returns it.

    NOTE: a private aten op (torch keeps no promise for it; pyproject bounds torch to 2.13-2.14),
    chosen as the public SDPA gives no log-sum-exp; tests/engine/test_own_rows.py fails first if it
    changes."""
    if q.shape[0] == 0:
        return q.new_zeros(q.shape), q.new_zeros(q.shape[:2])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        0.0, causal, attn_mask=mask, scale=scale)
    return out.squeeze(0).transpose(0, 1), lse.squeeze(0).transpose(0, 1)

