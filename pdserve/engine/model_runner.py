"""Turns a scheduled step into tensors, runs the model, returns logits.

Owns the KV cache tensor: kv[layer, k|v, block, offset, kv_head, row], where a
row is head_dim values, or head_dim codes and a scale (pdserve/engine/kv_format.py).
The pool's blocks are 0..num_blocks-1; one more, the null block (index num_blocks), is
where the padded rows of a static decode step write (pdserve/engine/static_decode.py).

A pure-decode step runs through the static step where the engine has one (CUDA: a
captured graph per batch bucket), every other step through the forward built here.

Token rows are ordered decode tokens first, then prefill chunks, so decode
attention is one batched call over a contiguous slice (see model.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.kv_format import KV_FORMATS
from pdserve.engine.model import AttentionMetadata, DecoderModel, LayerDoneCallback, PrefillSegment
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.static_decode import StaticDecode
from pdserve.units import ceil_div


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor
    sampled: list[ScheduledChunk]  # chunks whose logits come back, in logit_rows order


def allocate_kv_cache(model: DecoderModel, num_blocks: int, block_size: int, kv_dtype: str) -> torch.Tensor:
    """The pool's num_blocks blocks and, after them, the null block (null_block_of)."""
    c, fmt = model.config, KV_FORMATS[kv_dtype]
    # NOTE: zeros, not empty: padded decode attention multiplies masked rows by 0,
    # and 0 * NaN from uninitialised memory would poison the output (a zero scale reads as 0 too).
    return torch.zeros(c.num_layers, 2, num_blocks + 1, block_size, c.num_kv_heads, fmt.row_width(c.head_dim),
                       dtype=fmt.storage_dtype, device=model.device)


def null_block_of(kv_cache: torch.Tensor) -> int:
    """The block no sequence owns, which padded decode rows write: the last of allocate_kv_cache's."""
    return kv_cache.shape[2] - 1


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, block_size: int,
                 static_decode: StaticDecode | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = model.device
        self.static_decode = static_decode  # None: every step builds its own tensors

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk],
            on_layer_done: LayerDoneCallback | None = None) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        if on_layer_done is None and self.static_decode is not None and self.static_decode.fits(chunks):
            return self.static_decode.run(chunks), list(chunks)
        inputs = self.prepare(chunks)
        logits = self.model.forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache,
                                    inputs.logit_rows, on_layer_done)
        return logits, inputs.sampled

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        decodes = [c for c in chunks if c.num_tokens == 1 and c.start > 0]
        prefills = [c for c in chunks if not (c.num_tokens == 1 and c.start > 0)]
        ordered = decodes + prefills
        ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        logit_rows: list[int] = []
        sampled: list[ScheduledChunk] = []
        segments: list[PrefillSegment] = []
        bs = self.block_size
        for c in ordered:
            q_start = len(ids)
            ids.extend(c.seq.token_ids[c.start:c.end])
            positions.extend(range(c.start, c.end))
            table = c.seq.block_ids
            slot_blocks.extend(table[p // bs] for p in range(c.start, c.end))
            if c.samples:
                logit_rows.append(len(ids) - 1)
                sampled.append(c)
            if not (c.num_tokens == 1 and c.start > 0):
                segments.append(PrefillSegment(q_start, c.num_tokens, c.start, self._tensor(table)))
        pos = self._tensor(positions)
        meta = AttentionMetadata(
            slot_blocks=self._tensor(slot_blocks), slot_offsets=pos % bs, num_decode=len(decodes),
            decode_block_tables=self._padded_tables(decodes) if decodes else None,
            decode_context_lens=self._tensor([c.end for c in decodes]) if decodes else None,
            prefills=tuple(segments))
        return StepInputs(self._tensor(ids), pos, meta, self._tensor(logit_rows), sampled)

    def _padded_tables(self, decodes: list[ScheduledChunk]) -> torch.Tensor:
        width = max(ceil_div(c.end, self.block_size) for c in decodes)
        rows = [c.seq.block_ids[:width] + [0] * (width - min(width, len(c.seq.block_ids)))
                for c in decodes]
        return self._tensor(rows)

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
