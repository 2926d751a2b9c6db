"""The decoder of every family pdserve serves, over a paged KV cache.

Llama's: RMSNorm, RoPE, grouped-query attention, a gated MLP, tied or untied embeddings; and
what each family adds, switched on by its row of pdserve/engine/families.py: q/k/v biases
(Qwen2), an RMSNorm over each q and k head (Qwen3, Gemma 3), norms by (1 + w), post-sublayer
norms, scaled embeddings and GELU-tanh (Gemma 3); and by the checkpoint's ModelConfig: llama3 or
linear rope scaling, a sliding window on some layers with their own rope theta (Gemma 3, Mistral),
an attention scale of query_pre_attn_scalar. One forward runs a flat batch of T tokens that mixes
decode tokens and prefill chunks of several sequences:

    hidden [T, d] --(per layer)--> q,k,v --RoPE--> write k,v at slot_mapping
        attention: decode tokens  -> pdserve's paged kernel over their block tables
                                     (attention_kernel native on the CPU, triton on
                                     CUDA), or SDPA over gathered groups of similar
                                     length (sdpa)
                   prefill chunks -> pdserve's paged flash kernel over the chunk's
                                     block table (native, triton), or one causal SDPA
                                     per chunk (sdpa: fresh K/V when the chunk starts
                                     at 0, else gathered and masked)
    --> norm --> lm_head on the sampled rows only

A windowed layer's query at position p attends positions p - window < s <= p, on every path (the
paged kernels skip the rows before, the SDPA paths mask them), as transformers' sliding_window
does; every block stays in the pool, so a window changes the math but not yet the memory.

KV cache layout: kv[layer, 0|1, block, offset, kv_head, row], so the K (or V)
rows of one block of one layer are contiguous bytes, which is what the KV wire
codec sends. A row is head_dim values in float32/float16/bfloat16, or head_dim
int8/fp8 codes and their scale (pdserve/engine/kv_format.py). Compute runs in the model's
dtype (EngineConfig.dtype: float32 on the CPU, bfloat16 on CUDA by default), norms and RoPE's
tables in float32 inside, as transformers does; attention in attention_dtype (the model's over cast
rows, float32 over quantized ones), every loaded row cast to it; logits come out float32.
Every path writes rows with the pool's format and attends over what it reads
back, a fresh prefill included, so no path sees other K/V values than another;
the one exception is the same on every path: an int8 query attends its own
token's K/V as computed, in float32 (KVFormat.own_row_in_float32).
An int8 row is stored Hadamard-rotated; attention then runs in that basis
(queries rotated in, the output rotated back), which is the identity for the
other formats.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine import cpu_kernels
from pdserve.engine.config import ModelConfig
from pdserve.engine.cpu_kernels import PagedDecodeAttention, PagedPrefillAttention
from pdserve.engine.families import FAMILIES
from pdserve.engine.kv_format import KV_FORMATS, CastFormat, KVFormat, format_of
from pdserve.engine.linear import Linear, MatmulLinear, NativeLinear, PanelWeight, PreparedWeight
from pdserve.engine.own_rows import OwnRows, attend_with_own_rows, own_rows_at, with_own_rows
from pdserve.engine.pointwise import Rotation, TorchPointwise
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


def plain_inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """RoPE's head_dim / 2 inverse frequencies at theta, unscaled (transformers' default rope)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def inverse_frequencies(config: ModelConfig, theta: float, scaled: bool) -> torch.Tensor:
    """RoPE's head_dim / 2 inverse frequencies at theta, with the config's scaling where `scaled`
    (transformers' _compute_llama3_parameters and linear scaling, op for op; a GGUF's rope_freqs
    divide them as llama.cpp does)."""
    inv_freq = plain_inverse_frequencies(config.head_dim, theta)
    if not scaled:
        return inv_freq
    if config.rope_freq_factors:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    if config.rope_scaling == "linear":
        return inv_freq / config.rope_factor
    if config.rope_scaling != "llama3":
        return inv_freq
    factor, low, high = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
    old_context = config.rope_original_max_positions
    wavelen = 2 * math.pi / inv_freq
    scaled_freq = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled_freq / factor + smooth * scaled_freq
    medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled_freq)


class RotaryEmbedding:
    def __init__(self, inv_freq: torch.Tensor, max_positions: int, device: torch.device,
                 dtype: torch.dtype = torch.float32):
        """The cos and sin tables, computed in float32 and cast to the model's dtype, as transformers
        casts them before rotating q and k."""
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

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


def _context_mask(lens: torch.Tensor, width: int, window: int | None = None) -> torch.Tensor:
    """[B, 1, 1, width] True where a decode query may attend: its own context, not padding, and
    within the window when there is one (the query is at position len - 1)."""
    keys = torch.arange(width, device=lens.device)[None, :]
    mask = keys < lens[:, None]
    if window is not None:
        mask &= keys > lens[:, None] - 1 - window
    return mask[:, None, None, :]


def causal_mask(start: int, q_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[q_len, start + q_len] True where the query at start + i may attend: the keys up to it, and
    within the window when there is one."""
    q_pos = torch.arange(start, start + q_len, device=device)[:, None]
    keys = torch.arange(start + q_len, device=device)[None, :]
    mask = keys <= q_pos
    return mask & (keys > q_pos - window) if window is not None else mask


@dataclass(frozen=True)
class PagedAttention:
    """pdserve's own attention over the paged pool (attention_kernel native or triton): it reads each
    K/V row where it lies, through the block tables, for decode rows and prefill chunks alike.

    reads_own_rows: the kernels take a query's own K/V in float32 (own_k=, own_v=), so they serve the
    formats that attend them so (int8); native reads float32 pools only, which have none."""

    decode: PagedDecodeAttention  # one query per sequence
    prefill: PagedPrefillAttention  # one chunk of one sequence, causal
    reads_own_rows: bool = False


def select_attention(device: torch.device, kernel: str = "sdpa") -> PagedAttention | None:
    """The attention named by EngineConfig.attention_kernel, once auto is resolved: None for sdpa
    (the model's own)."""
    if kernel == "sdpa":
        return None
    if kernel == "triton":
        return _triton_attention(device)
    if kernel != "native":
        raise ValueError(f"attention kernel {kernel!r}: use sdpa, native or triton")
    if device.type != "cpu":
        raise ValueError(f"attention_kernel 'native' runs on the CPU only, not on {device}; use sdpa or auto")
    if cpu_kernels.unavailable():
        raise ValueError(f"attention_kernel 'native' is not available: {cpu_kernels.unavailable()}; "
                         "use sdpa or auto")
    return PagedAttention(cpu_kernels.paged_decode_attention(), cpu_kernels.paged_prefill_attention())


def _triton_attention(device: torch.device) -> PagedAttention:
    from pdserve.engine import triton_attention

    reason = triton_attention.unavailable()
    if device.type != "cuda" and reason is None and not triton_attention.interpreted():
        reason = f"the device is {device}: Triton's kernels run on CUDA (on the CPU under TRITON_INTERPRET=1)"
    if reason is not None:
        raise ValueError(f"attention_kernel 'triton' cannot run: {reason}; use sdpa or auto")
    return PagedAttention(triton_attention.paged_decode_attention, triton_attention.paged_prefill_attention,
                          reads_own_rows=True)


def attention_dtype(fmt: KVFormat, dtype: torch.dtype) -> torch.dtype:
    """What q and the K/V rows attend in: the model's dtype over a pool of cast rows, and float32 over
    a quantized one (its scales, its rotation and int8's own rows are float32). Every path casts
    the rows it loads to it, and reference_logits does too, so they attend the same values."""
    return dtype if isinstance(fmt, CastFormat) else torch.float32


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


class DecoderModel:
    """Weights plus the forward pass, for any family of pdserve/engine/families.py (Llama's layout
    with the family's parts switched on). Stateless apart from the weights."""

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor],
                 device: torch.device, linear: Linear | None = None,
                 paged_attention: PagedAttention | None = None,
                 pointwise: TorchPointwise | None = None, dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.family = FAMILIES[config.architecture]
        self.device = device
        self.dtype = dtype  # of the weights and activations (EngineConfig.dtype, resolved)
        self.linear = linear or MatmulLinear()
        self.pointwise = pointwise or TorchPointwise()
        self.paged_attention = paged_attention  # None: SDPA over gathered K/V
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.attention_scale
        self.windows = [c.window_of(i) for i in range(c.num_layers)]
        sd = {k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()}
        # NOTE: every matmul weight is stored as self.linear wants it (pdserve/engine/linear.py), and
        # only so: nothing here keeps the weights as loaded, so they are freed with the loaded model.
        embed = sd["model.embed_tokens.weight"]
        self.lm_head = self.linear.prepare(embed if c.tie_word_embeddings else sd["lm_head.weight"])
        self.embed = EmbeddingTable.of(embed, self.lm_head if c.tie_word_embeddings else None)
        # Gemma 3 scales its embeddings by sqrt(hidden), rounded to the weights' dtype as transformers does
        self.embed_scale = (torch.tensor(c.hidden_size ** 0.5, dtype=dtype, device=device)
                            if self.family.scale_embeddings else None)
        self.final_norm = self._norm(sd["model.norm.weight"])
        self.layers = [self._layer_weights(sd, i) for i in range(c.num_layers)]
        self.rope = RotaryEmbedding(inverse_frequencies(c, c.rope_theta, scaled=True),
                                    c.max_position_embeddings, device, dtype)
        # the sliding layers' own table (Gemma 3's local theta), else the one above
        self.local_rope = (RotaryEmbedding(inverse_frequencies(c, c.rope_local_theta, scaled=False),
                                           c.max_position_embeddings, device, dtype)
                           if c.rope_local_theta is not None and c.sliding_layers else None)

    def _norm(self, weight: torch.Tensor) -> torch.Tensor:
        """A norm's scale as the model multiplies by it: the family's offset + w (Gemma: 1 + w,
        the sum transformers computes at each call, computed once here)."""
        if not self.family.norm_offset:
            return owned(weight)
        # NOTE: float32 whatever the model's dtype: Gemma scales the normed row in float32 and rounds after
        # (transformers' Gemma3RMSNorm), TorchPointwise.rms_norm's order for a float32 scale
        return self.family.norm_offset + weight.float()

    def _layer_weights(self, sd: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        prepare, c = self.linear.prepare, self.config
        # NOTE: fused projections: one GEMM for q/k/v and one for gate/up.
        weights = {
            "qkv": prepare(torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"],
                                      sd[a + "v_proj.weight"]])),
            "o": prepare(sd[a + "o_proj.weight"]),
            "gate_up": prepare(torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])),
            "down": prepare(sd[m + "down_proj.weight"]),
            "ln1": self._norm(sd[p + "input_layernorm.weight"]),
        }
        if self.family.post_norms:  # Gemma: post_attention_layernorm norms the attention's output
            weights |= {"post_attention": self._norm(sd[p + "post_attention_layernorm.weight"]),
                        "ln2": self._norm(sd[p + "pre_feedforward_layernorm.weight"]),
                        "post_mlp": self._norm(sd[p + "post_feedforward_layernorm.weight"])}
        else:
            weights["ln2"] = self._norm(sd[p + "post_attention_layernorm.weight"])
        if self.family.qkv_bias:
            weights["qkv_bias"] = torch.cat([sd[a + "q_proj.bias"], sd[a + "k_proj.bias"],
                                             sd[a + "v_proj.bias"]])
        if self.family.qk_norm:  # one [H + KVH, D] scale: q's weight on each query head, then k's
            weights["qk_norm"] = torch.cat([self._norm(sd[a + "q_norm.weight"]).expand(c.num_heads, -1),
                                            self._norm(sd[a + "k_norm.weight"]).expand(c.num_kv_heads, -1)])
        return weights

    def _rotations(self, positions: torch.Tensor) -> list[Rotation]:
        """Each layer's cos/sin rows at these positions (looked up once per table per step)."""
        full = self.rope.at(positions)
        local = self.local_rope.at(positions) if self.local_rope is not None else full
        return [local if window is not None else full for window in self.windows]

    # --- paged forward ---------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, logit_rows: torch.Tensor,
                on_layer_done: LayerDoneCallback | None = None) -> torch.Tensor:
        """Run T tokens through the model; returns float32 logits for logit_rows only."""
        h = self._embed(input_ids)
        # NOTE: per-step tensors shared by every layer are built once here, not per layer:
        # at batch 1 a decode step is dominated by the count of small ops, not by FLOPs.
        rotations = self._rotations(positions)
        fmt = format_of(kv_cache.dtype)
        decode_groups = ({window: self._decode_groups(meta, kv_cache.shape[3], window)
                          for window in set(self.windows)}
                         if meta.num_decode and self.paged_attention is None else {})
        norm, eps = self.pointwise, self.config.rms_norm_eps
        residual = None  # the sum of the embeddings and every sublayer's output so far
        for i, w in enumerate(self.layers):
            x, residual = norm.add_rms_norm(h, residual, w["ln1"], eps)
            window = self.windows[i]
            h = self._attention(x, rotations[i], w, kv_cache[i], fmt, meta, decode_groups.get(window, []),
                                window)
            if "post_attention" in w:
                h = norm.rms_norm(h, w["post_attention"], eps)
            x, residual = norm.add_rms_norm(h, residual, w["ln2"], eps)
            h = self._mlp(x, w)
            if on_layer_done is not None:
                on_layer_done(i)
        h = norm.rms_norm(residual[logit_rows] + h[logit_rows], self.final_norm, eps)
        return self.linear(h, self.lm_head).float()  # NOTE: no copy in float32

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed.rows(ids)
        return h * self.embed_scale if self.embed_scale is not None else h

    def _mlp(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        gate_up = self.linear(x, w["gate_up"])
        act = (self.pointwise.silu_and_mul(gate_up) if self.family.activation == "silu"
               else self.pointwise.gelu_tanh_and_mul(gate_up))
        out = self.linear(act, w["down"])
        if "post_mlp" in w:
            return self.pointwise.rms_norm(out, w["post_mlp"], self.config.rms_norm_eps)
        return out

    def _qkv(self, x: torch.Tensor, rot, w: dict[str, torch.Tensor]):
        """q [T, H, D] and k [T, KVH, D] rotated, v [T, KVH, D]; q and k rotate as one tensor
        (each head normed first where the family norms them)."""
        c = self.config
        qkv = self.linear(x, w["qkv"])
        if "qkv_bias" in w:
            qkv = qkv + w["qkv_bias"]
        heads = c.num_heads + c.num_kv_heads
        if "qk_norm" in w:
            qk = qkv[:, :heads * c.head_dim].view(-1, heads, c.head_dim)
            qkv[:, :heads * c.head_dim] = TorchPointwise.rms_norm(self.pointwise, qk, w["qk_norm"],
                                                                  c.rms_norm_eps).flatten(1)
        qk = self.pointwise.rotary(qkv, rot, heads, c.head_dim)
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        return q, k, qkv[:, self.q_size + self.kv_size:].view(-1, c.num_kv_heads, c.head_dim)

    def _attention(self, x, rot, w, layer_cache: torch.Tensor, fmt: KVFormat, meta: AttentionMetadata,
                   decode_groups: list[DecodeGroup], window: int | None = None):
        q, k, v = self._qkv(x, rot, w)
        at = attention_dtype(fmt, x.dtype)
        q, k, v = q.to(at), k.to(at), v.to(at)  # NOTE: no copies where at is x's dtype (float32's path)
        # NOTE: attention runs in the rows' basis (int8: Hadamard-rotated; kv_format.py), so the
        # queries and fresh K/V rotate once and the output rotates back once, never a cached row.
        q, k, v = fmt.rotate(q), fmt.rotate(k), fmt.rotate(v)
        # NOTE: fresh K/V attend as the pool gives them back (rounded, or quantized and scaled),
        # so every path (fresh prefill, prefix hit, transferred, decode) sees the very same values.
        k_rows, v_rows = fmt.store_rotated(k), fmt.store_rotated(v)  # k itself for float32: no copy
        layer_cache[0, meta.slot_blocks, meta.slot_offsets] = k_rows
        layer_cache[1, meta.slot_blocks, meta.slot_offsets] = v_rows
        own = (k, v) if fmt.own_row_in_float32 else None
        k, v = fmt.load_rotated(k_rows).to(at), fmt.load_rotated(v_rows).to(at)
        nd = meta.num_decode
        if not meta.prefills:  # a decode-only step: no output to assemble
            out = self._decode_attention(q, layer_cache, fmt, meta, decode_groups, own, window)
            return self.linear(fmt.unrotate(out).reshape(-1, self.q_size).to(x.dtype), w["o"])
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode_attention(q[:nd], layer_cache, fmt, meta, decode_groups,
                                              own_rows_at(own, slice(0, nd)), window)
        for seg in meta.prefills:
            rows = slice(seg.q_start, seg.q_start + seg.q_len)
            out[rows] = self._prefill_attention(q[rows], k[rows], v[rows], seg, layer_cache, fmt,
                                                own_rows_at(own, rows), window)
        return self.linear(fmt.unrotate(out).reshape(-1, self.q_size).to(x.dtype), w["o"])

    @staticmethod
    def _decode_groups(meta: AttentionMetadata, block_size: int,
                       window: int | None = None) -> list[DecodeGroup]:
        """The decode rows sorted by context length, cut into groups of DECODE_GROUP_ROWS; each
        group's mask leaves out padding and, for a windowed layer, the keys before the window.

        NOTE: each group gathers only as many blocks as its longest row needs, so a short
        sequence next to a long one no longer pays for the long one's padding. Masked keys
        weigh exactly 0, so the grouping changes no value (tests/engine/test_exactness.py).
        """
        lens, tables = meta.decode_context_lens, meta.decode_block_tables
        if len(lens) <= DECODE_GROUP_ROWS:
            mask = _context_mask(lens, tables.shape[1] * block_size, window)
            return [DecodeGroup(None, tables, mask, lens - 1)]
        groups = []
        for rows in torch.argsort(lens, stable=True).split(DECODE_GROUP_ROWS):
            group_lens = lens[rows]
            width = ceil_div(int(group_lens.max()), block_size)
            groups.append(DecodeGroup(rows, tables[rows, :width].contiguous(),
                                      _context_mask(group_lens, width * block_size, window), group_lens - 1))
        return groups

    def _decode_attention(self, q: torch.Tensor, layer_cache: torch.Tensor, fmt: KVFormat,
                          meta: AttentionMetadata, groups: list[DecodeGroup],
                          own: OwnRows | None = None, window: int | None = None) -> torch.Tensor:
        """q: [B, H, D], one query per sequence: pdserve's paged kernel over the block tables, or
        SDPA with the keys gathered group by group (the groups' masks carry the window). own: the
        rows' own K/V in float32, where the format attends them so (the paged kernel reads float32
        pools only, which have no own rows)."""
        if self.paged_attention is not None:
            return self.paged_attention.decode(q.contiguous(), layer_cache, meta.decode_block_tables,
                                               meta.decode_context_lens, self.scale, window or 0,
                                               **self._own_rows_arguments(own))
        if groups[0].rows is None:
            return self._group_attention(q, layer_cache, fmt, groups[0], own)
        out = torch.empty_like(q)
        for group in groups:
            out[group.rows] = self._group_attention(q[group.rows], layer_cache, fmt, group,
                                                    own_rows_at(own, group.rows))
        return out

    def _own_rows_arguments(self, own: OwnRows | None) -> dict[str, torch.Tensor]:
        """The paged kernel's own-row arguments: none for a format without own rows."""
        if own is None:
            return {}
        assert self.paged_attention is not None and self.paged_attention.reads_own_rows, \
            "the paged kernel reads no own rows (native serves float32 pools only)"
        return {"own_k": own[0], "own_v": own[1]}

    def _group_attention(self, q: torch.Tensor, layer_cache: torch.Tensor, fmt: KVFormat,
                         group: DecodeGroup, own: OwnRows | None = None) -> torch.Tensor:
        b = q.shape[0]
        # NOTE: index_select, not layer_cache[:, tables]: the same gather, but advanced indexing
        # costs milliseconds per layer on 2 busy threads (docs/benchmarks.md, profile).
        kv = layer_cache.index_select(1, group.block_tables.view(-1))  # [2, b*blocks, bs, kvh, row]
        kv = kv.view(2, b, -1, self.config.num_kv_heads, layer_cache.shape[-1]).transpose(2, 3)
        kv = fmt.load_rotated(kv).to(q.dtype)  # [2, b, kvh, blocks * bs, D], a copy
        if own is not None:  # each row's own K/V replace their stored copy, at its own position
            rows = torch.arange(b, device=q.device)
            kv[0][rows, :, group.own_positions] = own[0]
            kv[1][rows, :, group.own_positions] = own[1]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), kv[0], kv[1], attn_mask=group.mask,
                                             scale=self.scale, enable_gqa=True)
        return out.squeeze(2)

    def _prefill_attention(self, q, k, v, seg: PrefillSegment, layer_cache: torch.Tensor, fmt: KVFormat,
                           own: OwnRows | None = None, window: int | None = None):
        """Causal attention of one chunk, within the window where the layer has one; earlier context
        comes from the cache (the chunk's own rows are in it already). own: the chunk's K/V in
        float32, where the format attends them so."""
        if self.paged_attention is not None:
            return self.paged_attention.prefill(q.contiguous(), layer_cache, seg.block_table, seg.start,
                                                self.scale, window or 0, **self._own_rows_arguments(own))
        ctx = seg.start + seg.q_len
        if seg.start == 0:
            keys, values = k, v
        else:
            rows = layer_cache.index_select(1, seg.block_table).flatten(1, 2)[:, :ctx]
            kv = fmt.load_rotated(rows).to(q.dtype)
            keys, values = kv[0], kv[1]
        if own is not None and q.device.type == "cpu" and window is None:
            return attend_with_own_rows(q, keys, values, own, seg.start, self.scale)
        if own is not None:
            return sdpa_4d(q, *with_own_rows(keys, values, own, seg.start, window), False, self.scale)
        if seg.start == 0 and window is None:
            return sdpa_4d(q, keys, values, None, True, self.scale)
        mask = causal_mask(seg.start, seg.q_len, window, q.device)
        return sdpa_4d(q, keys, values, mask, False, self.scale)

    # --- reference -----------------------------------------------------------------
    def reference_logits(self, token_ids: list[int], kv_dtype: str = "float32") -> torch.Tensor:
        """No-cache reference: the whole sequence recomputed densely; logits of every position.
        K/V go through kv_dtype's round trip as a cache of that dtype stores them (nothing for
        float32), each query's own row stays float32 where the format says so, and attention runs in
        the rows' basis as the paged forward's does, so it is the reference of an engine with that
        cache. It runs in the model's dtype and attends in attention_dtype, as the forward does; float32
        logits."""
        fmt = KV_FORMATS[kv_dtype]
        ids = torch.tensor(token_ids, device=self.device)
        rotations = self._rotations(torch.arange(len(token_ids), device=self.device))
        h = self._embed(ids)
        norm, eps = self.pointwise, self.config.rms_norm_eps
        for w, rot, window in zip(self.layers, rotations, self.windows, strict=True):
            x = norm.rms_norm(h, w["ln1"], eps)
            q, k, v = self._qkv(x, rot, w)
            at = attention_dtype(fmt, x.dtype)
            q, k, v = fmt.rotate(q.to(at)), fmt.rotate(k.to(at)), fmt.rotate(v.to(at))
            own = (k, v) if fmt.own_row_in_float32 else None
            k, v = (fmt.load_rotated(fmt.store_rotated(k)).to(at),
                    fmt.load_rotated(fmt.store_rotated(v)).to(at))
            if own is not None:
                attn = sdpa_4d(q, *with_own_rows(k, v, own, 0, window), False, self.scale)
            elif window is not None:
                attn = sdpa_4d(q, k, v, causal_mask(0, len(token_ids), window, q.device), False, self.scale)
            else:
                attn = sdpa_4d(q, k, v, None, True, self.scale)
            attn = self.linear(fmt.unrotate(attn).reshape(-1, self.q_size).to(x.dtype), w["o"])
            h = h + (norm.rms_norm(attn, w["post_attention"], eps) if "post_attention" in w else attn)
            h = h + self._mlp(norm.rms_norm(h, w["ln2"], eps), w)
        return self.linear(norm.rms_norm(h, self.final_norm, eps), self.lm_head).float()
