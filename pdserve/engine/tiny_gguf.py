"""The GGUF that llama.cpp's convert_hf_to_gguf.py (--outtype f32) writes for a Hugging Face
checkpoint of one of pdserve's families, for tests: a tiny model's twin, loaded through the GGUF path.

    config.json, model.safetensors ─ load_hf_directory ─▶ ModelConfig + HF state dict
        ─ the family's `{arch}.*` keys ─ tensor names by gguf-py's own map (get_tensor_name_map)
        ─ Q/K rows permuted (Llama layout) ─ norms + 1 (Gemma) ─ rope_freqs (a Llama 3 rope)
    tokenizer.json, tokenizer_config.json ─ tokens and types as get_vocab_base lists them,
        merges, special ids and chat template by gguf-py's SpecialVocab ─▶ tokenizer.ggml.*

What it writes beyond the converter, where the converter's file would run a different model than its
checkpoint (each is a key that gguf-py defines and pdserve's loader reads):
    {arch}.attention.sliding_window_pattern   Gemma 3 layers whose windows are not llama.cpp's
                                              fixed pattern (all but each 6th layer)
    {arch}.rope.freq_base_swa                 a Gemma 3 local rope base other than 10000
What no GGUF carries, and the loader derives as llama.cpp does: Gemma 3's query_pre_attn_scalar
(head_dim), a Mistral window (none: llama.cpp runs Mistral as llama, with full attention), and
Llama 3's rope parameters, which become the factors of rope_freqs.

The tokenizer's pre-tokenizer name (tokenizer.ggml.pre) is what llama.cpp picks by hashing the
tokenizer's output on a fixed text; the tiny models use SmolLM2's tokenizer, hence "smollm".
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.families import FAMILIES, Family
from pdserve.engine.weights import load_hf_directory

if TYPE_CHECKING:
    import gguf

_GEMMA3_PATTERN, _GEMMA3_LOCAL_THETA = 6, 10_000.0  # what llama.cpp assumes (gguf_weights.py reads both)


def write_tiny_gguf(hf_directory: str | Path, out_path: str | Path, *, tokenizer_pre: str = "smollm") -> Path:
    """Convert the checkpoint in hf_directory to a float32 GGUF at out_path and return out_path."""
    import gguf  # only GGUF writing needs it

    hf_directory, out_path = Path(hf_directory), Path(out_path)
    loaded = load_hf_directory(hf_directory, progress=False)
    config, family = loaded.config, FAMILIES[loaded.config.architecture]
    arch_name = family.gguf_architecture or "llama"  # Mistral's converter writes a llama file
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name)
    writer = gguf.GGUFWriter(str(out_path), arch_name)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(hf_directory.name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_hparams(writer, config, family)
    _add_vocab(writer, hf_directory, config, tokenizer_pre)
    names = gguf.get_tensor_name_map(arch, config.num_layers)
    for hf_name, tensor in _gguf_tensors(loaded.state_dict, config, family):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias")) if hf_name != "rope_freqs" else (
            gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight")
        if name is None:
            raise ValueError(f"gguf-py maps no {arch_name} tensor to {hf_name!r}")
        writer.add_tensor(name, np.ascontiguousarray(tensor.numpy(), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _add_hparams(writer: gguf.GGUFWriter, config: ModelConfig, family: Family) -> None:
    """The `{arch}.*` keys: TextModel's common ones, then each model class's own."""
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)  # Gemma 3: the global layers'
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)  # config.json gives head_dim
    writer.add_value_length(config.head_dim)
    if family.gguf_permuted_qk:  # DecoderModel
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.head_dim)
    if config.rope_scaling == "linear":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_factor)
    if family.name == "gemma3" and config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
        layers = range(config.num_layers)
        if tuple(i for i in layers if i % _GEMMA3_PATTERN < _GEMMA3_PATTERN - 1) != config.sliding_layers:
            writer.add_sliding_window_pattern([i in config.sliding_layers for i in layers])
        if config.rope_local_theta not in (None, _GEMMA3_LOCAL_THETA):
            writer.add_rope_freq_base_swa(config.rope_local_theta)


def _gguf_tensors(state_dict: dict[str, torch.Tensor], config: ModelConfig,
                  family: Family) -> list[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor as the converter stores it), and rope_freqs for a Llama 3 rope."""
    out = [("rope_freqs", llama3_rope_factors(config))] if config.rope_scaling == "llama3" else []
    for name, tensor in state_dict.items():
        if family.gguf_permuted_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = permute_rope_rows(tensor, config.num_heads)
        elif family.gguf_permuted_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = permute_rope_rows(tensor, config.num_kv_heads)
        elif family.norm_offset and name.endswith("norm.weight"):
            tensor = tensor + family.norm_offset  # llama.cpp's RMSNorm scales by the weight alone
        out.append((name, tensor))
    return out


def permute_rope_rows(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's DecoderModel.permute: each head's rows (2, dim/2) -> (dim/2, 2)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def llama3_rope_factors(config: ModelConfig) -> torch.Tensor:
    """DecoderModel.generate_extra_tensors: each rope frequency's divisor under Llama 3's scaling."""
    dim, factor = config.head_dim, config.rope_factor
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    old = config.rope_original_max_positions
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _add_vocab(writer: gguf.GGUFWriter, directory: Path, config: ModelConfig, tokenizer_pre: str) -> None:
    """_set_vocab_gpt2: the token list and types (get_vocab_base), then SpecialVocab's merges,
    special token ids, add_bos/add_eos and chat template."""
    import gguf
    from tokenizers import Tokenizer as BackendTokenizer

    backend = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
    by_id = {i: token for token, i in backend.get_vocab(with_added_tokens=True).items()}
    added = backend.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(config.vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].special or _looks_special(by_id[i])
                         else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(directory, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def _looks_special(token: str) -> bool:
    """The converter's does_token_look_special: added tokens some models leave unflagged."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))
