"""The decode step at fixed shapes: what a CUDA graph captures, and what the CPU runs eagerly to prove it.

A pure-decode step (one new token for each of B running sequences, no prefill chunk, no layer hook)
runs the model over tensors whose shapes depend only on a batch bucket, never on the step:

    run(chunks), B rows
      bucket = the smallest of BATCH_BUCKETS >= B (1, 2, 4, 8, 16, 32, 64, 128, 256, up to max_batch)
      fill the persistent buffers' first `bucket` rows (one host->device copy each):
          rows 0..B-1        each sequence's token, position, KV slot, block table, context length
          rows B..bucket-1   padding: token 0 at position 0, context length 0, block table and KV
                             slot in the null block, which no sequence owns
      CUDA and graphs on: replay the bucket's graph (captured at build, every bucket, largest first,
                          over all-padding buffers, so capture writes only the null block)
      else:               DecoderModel.forward over the same buffers, op by op
      -> logits of rows 0..B-1

Why the padding changes no real row: every op of the step is row-wise (embedding, norms, products,
rope) except attention, and a padded row's attention reads nothing (context length 0: its output is 0)
while a real row's reads only its own blocks, as far as its own context length; the padded rows'
K/V go to the null block, which no block table of a real row lists within its context. The tests
compare padded and unpadded steps' logits and KV bit for bit (tests/engine/test_static_decode.py).

Why nothing in the step reads a tensor's value on the host: a captured graph replays its kernels
with the buffers' new contents but never re-runs Python, so a branch on a value would be frozen at
capture. The step needs a paged attention kernel (triton, native) for that reason: the sdpa path sizes
its gathers from the context lengths. Block tables are as wide as the longest sequence the engine
admits, so their shape never changes either; the kernels stop at each row's context length.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.model import AttentionMetadata, DecoderModel
from pdserve.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def buckets_up_to(max_batch: int) -> tuple[int, ...]:
    """The buckets a static step of at most max_batch rows uses: each bucket up to the first that holds
    max_batch (so max_batch itself always fits), none past the largest."""
    out = []
    for bucket in BATCH_BUCKETS:
        out.append(bucket)
        if bucket >= max_batch:
            break
    return tuple(out)


def bucket_of(rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `rows`; None when none does."""
    return next((bucket for bucket in buckets if bucket >= rows), None)


def is_pure_decode(chunks: Sequence[ScheduledChunk]) -> bool:
    """One new token for each sequence, its last (so each row is sampled), none at position 0."""
    return bool(chunks) and all(c.num_tokens == 1 and c.start > 0 and c.samples for c in chunks)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab]: where each replay leaves its logits


class StaticDecode:
    """Pure-decode steps over persistent buffers, padded to batch buckets; captured as CUDA graphs
    where `graphs` (a CUDA device), else run eagerly."""

    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, block_size: int, null_block: int,
                 max_batch: int, max_blocks: int, graphs: bool) -> None:
        if model.paged_attention is None:
            raise ValueError("the static decode step needs a paged attention kernel (triton or native): "
                             "sdpa sizes its gathers from the context lengths")
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.null_block, self.max_blocks = null_block, max_blocks
        self.buckets = buckets_up_to(max_batch)
        rows, device = self.buckets[-1], model.device
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_blocks = torch.zeros(rows, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(rows, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((rows, max_blocks), dtype=torch.long, device=device)
        buffers = (self.input_ids, self.positions, self.slot_blocks, self.context_lens, self.block_tables)
        # NOTE: a step's rows are written on the host, then copied over in one transfer per buffer, from
        # pinned memory so the copy does not wait for the host (on the CPU the buffers are the host's).
        self._staged = (tuple(torch.zeros_like(b, device="cpu").pin_memory() for b in buffers)
                        if device.type == "cuda" else buffers)
        self._buffers = buffers
        self.logit_rows = torch.arange(rows, device=device)
        self.graphs: dict[int, _Captured] = {}
        if graphs:
            self._capture_all()

    def fits(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether this step can run here: pure decode, within the largest bucket and the table width."""
        return (is_pure_decode(chunks) and len(chunks) <= self.buckets[-1]
                and all(len(c.seq.block_ids) <= self.max_blocks for c in chunks))

    @torch.inference_mode()
    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Logits [len(chunks), vocab] of a step that fits()."""
        bucket = bucket_of(len(chunks), self.buckets)
        assert bucket is not None and self.fits(chunks), "run() takes a step that fits()"
        self._fill(chunks, bucket)
        captured = self.graphs.get(bucket)
        if captured is None:
            return self._forward(bucket)[:len(chunks)]
        captured.graph.replay()
        return captured.logits[:len(chunks)]

    def _fill(self, chunks: Sequence[ScheduledChunk], bucket: int) -> None:
        """The step's rows, then padding up to the bucket, into the buffers.

        NOTE: the host side is rewritten while no copy out of it can be pending: the engine reads the
        previous step's logits back to the host (sampling) before it builds the next step."""
        ids, positions, slots, lens, tables = (staged[:bucket].numpy() for staged in self._staged)
        ids[:], positions[:], lens[:] = 0, 0, 0
        slots[:], tables[:] = self.null_block, self.null_block
        for i, c in enumerate(chunks):
            table = c.seq.block_ids
            ids[i], positions[i], lens[i] = c.seq.token_ids[c.start], c.start, c.end
            slots[i] = table[c.start // self.block_size]
            tables[i, :len(table)] = table
        if self._staged is not self._buffers:
            for staged, buffer in zip(self._staged, self._buffers):
                buffer[:bucket].copy_(staged[:bucket], non_blocking=True)

    def _forward(self, bucket: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_blocks=self.slot_blocks[:bucket], slot_offsets=self.positions[:bucket] % self.block_size,
            num_decode=bucket, decode_block_tables=self.block_tables[:bucket],
            decode_context_lens=self.context_lens[:bucket], prefills=())
        return self.model.forward(self.input_ids[:bucket], self.positions[:bucket], meta, self.kv_cache,
                                  self.logit_rows[:bucket])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """One graph per bucket, largest first, sharing one memory pool (the largest's allocations
        serve the smaller ones), each captured over all-padding buffers."""
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            self._fill([], bucket)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            # NOTE: warm-up off the capture: Triton compiles its kernels, the allocator settles
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(bucket)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(bucket)
            self.graphs[bucket] = _Captured(graph, logits)
        torch.cuda.synchronize()
        log.info("captured the decode step as CUDA graphs for batch buckets %s",
                 ", ".join(map(str, self.buckets)))
