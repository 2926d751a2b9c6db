"""A Llama-family decoder over a paged KV cache.

RMSNorm, RoPE (configurable theta), grouped-query attention, SwiGLU, tied or
untied embeddings. One forward runs a flat batch of T tokens that mixes
decode tokens and prefill chunks of several sequences:

    hidden [T, d] --(per layer)--> q,k,v --RoPE--> write k,v at slot_mapping
        attention: decode tokens  -> pdserve's paged kernel over their block tables
                                     (attention_kernel native), or SDPA over gathered
                                     groups of similar length (sdpa)
                   prefill chunks -> pdserve's paged flash kernel over the chunk's
                                     block table (native), or one causal SDPA per
                                     chunk (sdpa: fresh K/V when the chunk starts
                                     at 0, else gathered and masked)
    --> norm --> lm_head on the sampled rows only

KV cache layout: kv[layer, 0|1, block, offset, kv_head, row], so the K (or V)
rows of one block of one layer are contiguous bytes, which is what the KV wire
codec sends. A row is head_dim values in float32/float16/bfloat16, or head_dim
int8/fp8 codes and their scale (pdserve/engine/kv_format.py); compute is float32.
Every path writes rows with the pool's format and attends over what it reads
back, a fresh prefill included, so no path sees other K/V values than another;
the one exception is the same on every path: an int8 query attends its own
token's K/V as computed, in float32 (KVFormat.own_row_in_float32).
An int8 row is stored Hadamard-rotated; attention then runs in that basis
(queries rotated in, the output rotated back), which is the identity for the
other formats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine import cpu_kernels
from pdserve.engine.config import ModelConfig
from pdserve.engine.cpu_kernels import PagedDecodeAttention, PagedPrefillAttention
from pdserve.engine.kv_format import KV_FORMATS, KVFormat, format_of
from pdserve.engine.linear import Linear, MatmulLinear, NativeLinear, PanelWeight, PreparedWeight
from pdserve.engine.own_rows import OwnRows, attend_with_own_rows, own_rows_at, with_own_rows
from pdserve.engine.pointwise import TorchPointwise
from pdserve.units import ceil_div


@dataclass(frozen=True)
class PrefillSegment:
    """One prefill chunk: rows [q_start, q_start+q_len) of the batch, at positions from start."""

    q_start: int
    q_len: int
    start: int
    block_table: torch.Tensor  # [num_blocks] long


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token's K/V goes and what each query attends to.

    Batch rows are ordered: all decode tokens first, then prefill chunks.
    """

    slot_blocks: torch.Tensor  # [T] block id of each token's KV row
    slot_offsets: torch.Tensor  # [T] offset inside that block
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] long, padded
    decode_context_lens: torch.Tensor | None  # [B] long
    prefills: tuple[PrefillSegment, ...]


LayerDoneCallback = Callable[[int], None]

DECODE_GROUP_ROWS = 8  # decode rows per attention gather; 8 measured best of 1..32 at 32 rows


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows of similar context length, attended together (built once per step)."""

    rows: torch.Tensor | None  # [g] long, indices into the decode rows; None: all, in order
    block_tables: torch.Tensor  # [g, blocks] long, padded to the group's longest row
    mask: torch.Tensor  # [g, 1, 1, blocks * block_size] True where a row may attend
    own_positions: torch.Tensor  # [g] long, each row's own token's position (context length - 1)


class RotaryEmbedding:
    def __init__(self, head_dim: int, max_positions: int, theta: float, device: torch.device):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for positions, shaped [T, 1, head_dim]: looked up once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def sdpa_4d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            causal: bool, scale: float) -> torch.Tensor:
    """Attention of one sequence; q [Tq, H, D], k/v [Tk, KVH, D] -> [Tq, H, D].

    NOTE: inputs go in as 4-D [1, heads, T, D]: with 3-D inputs torch's CPU SDPA
    falls back to the math kernel, about 8x slower at 2,048 tokens.
    """
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _context_mask(lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, 1, 1, width] True where a decode query may attend (its own context, not padding)."""
    return (torch.arange(width, device=lens.device)[None, :] < lens[:, None])[:, None, None, :]


@dataclass(frozen=True)
class PagedAttention:
    """pdserve's own attention over the paged pool (attention_kernel native): it reads each K/V row
    where it lies, through the block tables, for decode rows and prefill chunks alike."""

    decode: PagedDecodeAttention  # one query per sequence
    prefill: PagedPrefillAttention  # one chunk of one sequence, causal


def select_attention(device: torch.device, kernel: str = "sdpa") -> PagedAttention | None:
    """The attention named by EngineConfig.attention_kernel, once auto is resolved: None for sdpa
    (the model's own)."""
    if kernel == "sdpa":
        return None
    if kernel != "native":
        raise ValueError(f"attention kernel {kernel!r}: use sdpa or native")
    if device.type != "cpu":
        raise ValueError(f"attention_kernel 'native' runs on the CPU only, not on {device}; use sdpa or auto")
    if cpu_kernels.unavailable():
        raise ValueError(f"attention_kernel 'native' is not available: {cpu_kernels.unavailable()}; "
                         "use sdpa or auto")
    return PagedAttention(cpu_kernels.paged_decode_attention(), cpu_kernels.paged_prefill_attention())


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a loaded tensor that the model keeps as it is. NOTE: a loader's tensor can live in
    a private mapping of the weights file (safetensors maps it), and keeping any one of them keeps
    the whole file's pages resident beside the prepared copies."""
    return tensor.clone()


@dataclass(frozen=True)
class EmbeddingTable:
    """The embedding lookup: a table of its own, or, for a tied model whose lm_head's layout gives
    rows back as they are (native's panels), that lm_head's copy, so the weight is kept once."""

    table: torch.Tensor | None
    head: PanelWeight | None = None

    @staticmethod
    def of(embed: torch.Tensor, tied_head: PreparedWeight | None) -> EmbeddingTable:
        """tied_head: the lm_head prepared from `embed` (a tied model), else None."""
        if isinstance(tied_head, PanelWeight):
            return EmbeddingTable(None, tied_head)
        return EmbeddingTable(owned(embed))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return NativeLinear.rows(self.head, ids)
        assert self.table is not None
        return self.table[ids]


class LlamaModel:
    """Weights plus the forward pass. Stateless apart from the weights."""

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor],
                 device: torch.device, linear: Linear | None = None,
                 paged_attention: PagedAttention | None = None,
                 pointwise: TorchPointwise | None = None) -> None:
        self.config = config
        self.device = device
        self.linear = linear or MatmulLinear()
        self.pointwise = pointwise or TorchPointwise()
        self.paged_attention = paged_attention  # None: SDPA over gathered K/V
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.head_dim ** -0.5
        sd = {k: v.to(device=device, dtype=torch.float32) for k, v in state_dict.items()}
        # NOTE: every matmul weight is stored as self.linear wants it (pdserve/engine/linear.py), and
        # only so: nothing here keeps the weights as loaded, so they are freed with the loaded model.
        embed = sd["model.embed_tokens.weight"]
        self.lm_head = self.linear.prepare(embed if c.tie_word_embeddings else sd["lm_head.weight"])
        self.embed = EmbeddingTable.of(embed, self.lm_head if c.tie_word_embeddings else None)
        self.final_norm = owned(sd["model.norm.weight"])
        self.layers = [self._layer_weights(sd, i) for i in range(c.num_layers)]
        self.rope = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, device)

    def _layer_weights(self, sd: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        prepare = self.linear.prepare
        return {
            # NOTE: fused projections: one GEMM for q/k/v and one for gate/up.
            "qkv": prepare(torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"],
                                      sd[a + "v_proj.weight"]])),
            "o": prepare(sd[a + "o_proj.weight"]),
            "gate_up": prepare(torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])),
            "down": prepare(sd[m + "down_proj.weight"]),
            "ln1": owned(sd[p + "input_layernorm.weight"]),
            "ln2": owned(sd[p + "post_attention_layernorm.weight"]),
        }

    # --- paged forward ---------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, logit_rows: torch.Tensor,
                on_layer_done: LayerDoneCallback | None = None) -> torch.Tensor:
        """Run T tokens through the model; returns float32 logits for logit_rows only."""
        h = self.embed.rows(input_ids)
        # NOTE: per-step tensors shared by every layer are built once here, not per layer:
        # at batch 1 a decode step is dominated by the count of small ops, not by FLOPs.
        rot = self.rope.at(positions)
        fmt = format_of(kv_cache.dtype)
        decode_groups = (self._decode_groups(meta, kv_cache.shape[3])
                         if meta.num_decode and self.paged_attention is None else [])
        norm, eps = self.pointwise, self.config.rms_norm_eps
        residual = None  # the sum of the embeddings and every sublayer's output so far
        for i, w in enumerate(self.layers):
            x, residual = norm.add_rms_norm(h, residual, w["ln1"], eps)
            h = self._attention(x, rot, w, kv_cache[i], fmt, meta, decode_groups)
            x, residual = norm.add_rms_norm(h, residual, w["ln2"], eps)
            h = self._mlp(x, w)
            if on_layer_done is not None:
                on_layer_done(i)
        h = norm.rms_norm(residual[logit_rows] + h[logit_rows], self.final_norm, eps)
        return self.linear(h, self.lm_head)

    def _mlp(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.linear(self.pointwise.silu_and_mul(self.linear(x, w["gate_up"])), w["down"])

    def _qkv(self, x: torch.Tensor, rot, w: dict[str, torch.Tensor]):
        """q [T, H, D] and k [T, KVH, D] rotated, v [T, KVH, D]; q and k rotate as one tensor."""
        c = self.config
        qkv = self.linear(x, w["qkv"])
        qk = self.pointwise.rotary(qkv, rot, c.num_heads + c.num_kv_heads, c.head_dim)
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        return q, k, qkv[:, self.q_size + self.kv_size:].view(-1, c.num_kv_heads, c.head_dim)

    def _attention(self, x, rot, w, layer_cache: torch.Tensor, fmt: KVFormat, meta: AttentionMetadata,
                   decode_groups: list[DecodeGroup]):
        q, k, v = self._qkv(x, rot, w)
        # NOTE: attention runs in the rows' basis (int8: Hadamard-rotated; kv_format.py), so the
        # queries and fresh K/V rotate once and the output rotates back once, never a cached row.
        q, k, v = fmt.rotate(q), fmt.rotate(k), fmt.rotate(v)
        # NOTE: fresh K/V attend as the pool gives them back (rounded, or quantized and scaled),
        # so every path (fresh prefill, prefix hit, transferred, decode) sees the very same values.
        k_rows, v_rows = fmt.store_rotated(k), fmt.store_rotated(v)  # k itself for float32: no copy
        layer_cache[0, meta.slot_blocks, meta.slot_offsets] = k_rows
        layer_cache[1, meta.slot_blocks, meta.slot_offsets] = v_rows
        own = (k, v) if fmt.own_row_in_float32 else None
        k, v = fmt.load_rotated(k_rows), fmt.load_rotated(v_rows)
        nd = meta.num_decode
        if not meta.prefills:  # a decode-only step: no output to assemble
            out = self._decode_attention(q, layer_cache, fmt, meta, decode_groups, own)
            return self.linear(fmt.unrotate(out).reshape(-1, self.q_size), w["o"])
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode_attention(q[:nd], layer_cache, fmt, meta, decode_groups,
                                              own_rows_at(own, slice(0, nd)))
        for seg in meta.prefills:
            rows = slice(seg.q_start, seg.q_start + seg.q_len)
            out[rows] = self._prefill_attention(q[rows], k[rows], v[rows], seg, layer_cache, fmt,
                                                own_rows_at(own, rows))
        return self.linear(fmt.unrotate(out).reshape(-1, self.q_size), w["o"])

    @staticmethod
    def _decode_groups(meta: AttentionMetadata, block_size: int) -> list[DecodeGroup]:
        """The decode rows sorted by context length, cut into groups of DECODE_GROUP_ROWS.

        NOTE: each group gathers only as many blocks as its longest row needs, so a short
        sequence next to a long one no longer pays for the long one's padding. Masked keys
        weigh exactly 0, so the grouping changes no value (tests/engine/test_exactness.py).
        """
        lens, tables = meta.decode_context_lens, meta.decode_block_tables
        if len(lens) <= DECODE_GROUP_ROWS:
            return [DecodeGroup(None, tables, _context_mask(lens, tables.shape[1] * block_size), lens - 1)]
        groups = []
        for rows in torch.argsort(lens, stable=True).split(DECODE_GROUP_ROWS):
            group_lens = lens[rows]
            width = ceil_div(int(group_lens.max()), block_size)
            groups.append(DecodeGroup(rows, tables[rows, :width].contiguous(),
                                      _context_mask(group_lens, width * block_size), group_lens - 1))
        return groups

    def _decode_attention(self, q: torch.Tensor, layer_cache: torch.Tensor, fmt: KVFormat,
                          meta: AttentionMetadata, groups: list[DecodeGroup],
                          own: OwnRows | None = None) -> torch.Tensor:
        """q: [B, H, D], one query per sequence: pdserve's paged kernel over the block tables, or
        SDPA with the keys gathered group by group. own: the rows' own K/V in float32, where the
        format attends them so (the paged kernel reads float32 pools only, which have no own rows)."""
        if self.paged_attention is not None:
            return self.paged_attention.decode(q.contiguous(), layer_cache, meta.decode_block_tables,
                                               meta.decode_context_lens, self.scale)
        if groups[0].rows is None:
            return self._group_attention(q, layer_cache, fmt, groups[0], own)
        out = torch.empty_like(q)
        for group in groups:
            out[group.rows] = self._group_attention(q[group.rows], layer_cache, fmt, group,
                                                    own_rows_at(own, group.rows))
        return out

    def _group_attention(self, q: torch.Tensor, layer_cache: torch.Tensor, fmt: KVFormat,
                         group: DecodeGroup, own: OwnRows | None = None) -> torch.Tensor:
        b = q.shape[0]
        # NOTE: index_select, not layer_cache[:, tables]: the same gather, but advanced indexing
        # costs milliseconds per layer on 2 busy threads (docs/benchmarks.md, profile).
        kv = layer_cache.index_select(1, group.block_tables.view(-1))  # [2, b*blocks, bs, kvh, row]
        kv = kv.view(2, b, -1, self.config.num_kv_heads, layer_cache.shape[-1]).transpose(2, 3)
        kv = fmt.load_rotated(kv)  # [2, b, kvh, blocks * bs, D], a copy
        if own is not None:  # each row's own K/V replace their stored copy, at its own position
            rows = torch.arange(b, device=q.device)
            kv[0][rows, :, group.own_positions] = own[0]
            kv[1][rows, :, group.own_positions] = own[1]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), kv[0], kv[1], attn_mask=group.mask,
                                             scale=self.scale, enable_gqa=True)
        return out.squeeze(2)

    def _prefill_attention(self, q, k, v, seg: PrefillSegment, layer_cache: torch.Tensor, fmt: KVFormat,
                           own: OwnRows | None = None):
        """Causal attention of one chunk; earlier context comes from the cache (the chunk's own rows
        are in it already). own: the chunk's K/V in float32, where the format attends them so."""
        if self.paged_attention is not None:
            return self.paged_attention.prefill(q.contiguous(), layer_cache, seg.block_table, seg.start,
                                                self.scale)
        ctx = seg.start + seg.q_len
        if seg.start == 0:
            keys, values = k, v
        else:
            kv = fmt.load_rotated(layer_cache.index_select(1, seg.block_table).flatten(1, 2)[:, :ctx])
            keys, values = kv[0], kv[1]
        if own is not None and q.device.type == "cpu":
            return attend_with_own_rows(q, keys, values, own, seg.start, self.scale)
        if own is not None:
            return sdpa_4d(q, *with_own_rows(keys, values, own, seg.start), False, self.scale)
        if seg.start == 0:
            return sdpa_4d(q, keys, values, None, True, self.scale)
        q_pos = torch.arange(seg.start, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        return sdpa_4d(q, keys, values, mask, False, self.scale)

    # --- reference -----------------------------------------------------------------
    def reference_logits(self, token_ids: list[int], kv_dtype: str = "float32") -> torch.Tensor:
        """No-cache reference: the whole sequence recomputed densely; logits of every position.
        K/V go through kv_dtype's round trip as a cache of that dtype stores them (nothing for
        float32), each query's own row stays float32 where the format says so, and attention runs in
        the rows' basis as the paged forward's does, so it is the reference of an engine with that
        cache."""
        fmt = KV_FORMATS[kv_dtype]
        ids = torch.tensor(token_ids, device=self.device)
        rot = self.rope.at(torch.arange(len(token_ids), device=self.device))
        h = self.embed.rows(ids)
        norm, eps = self.pointwise, self.config.rms_norm_eps
        for w in self.layers:
            x = norm.rms_norm(h, w["ln1"], eps)
            q, k, v = self._qkv(x, rot, w)
            q, k, v = fmt.rotate(q), fmt.rotate(k), fmt.rotate(v)
            own = (k, v) if fmt.own_row_in_float32 else None
            k, v = fmt.load_rotated(fmt.store_rotated(k)), fmt.load_rotated(fmt.store_rotated(v))
            if own is not None:
                attn = fmt.unrotate(sdpa_4d(q, *with_own_rows(k, v, own, 0), False, self.scale))
            else:
                attn = fmt.unrotate(sdpa_4d(q, k, v, None, True, self.scale))
            h = h + self.linear(attn.reshape(-1, self.q_size), w["o"])
            h = h + self._mlp(norm.rms_norm(h, w["ln2"], eps), w)
        return self.linear(norm.rms_norm(h, self.final_norm, eps), self.lm_head)
