"""`pdserve plan --model` names the model's family and attention shape and, for sliding-window layers,
what their KV would be if only the window were kept (every block is kept today, and it says so)."""

from __future__ import annotations

import json

import pytest

from deploy import cli
from pdserve.engine.config import ModelConfig
from pdserve.window_plan import family_plan


def test_a_gemma3_folder_names_its_window_and_what_keeping_only_it_would_hold(family_model, capsys):
    directory, _ = family_model("gemma3")  # 2 layers, layer 0 within 24 tokens; 1 KV head of 32, float32
    assert cli.main(["plan", "--model", str(directory), "--tokens", "100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "model: gemma3, 2 layers, 4 query heads, 1 KV heads, head_dim 32"
    assert lines[1] == "  sliding window: 1 of 2 layers attend within the last 24 tokens"
    per_token = 2 * 1 * 32 * 4  # K and V, one layer, one KV head, head_dim 32, float32
    assert lines[2] == (f"  their KV per sequence: {100 * per_token:,} B for 100 tokens, as pdserve keeps "
                        f"every block today; {24 * per_token:,} B if only the window (24 tokens) were kept")
    assert lines[3].startswith("KV cache: 2 layers x 1 KV heads x head_dim 32")


def test_the_json_carries_the_same(family_model, capsys):
    directory, _ = family_model("mistral")  # both layers within 40 tokens; 2 KV heads of 16
    argv = ["plan", "--model", str(directory), "--tokens", "30", "--dtype", "float16", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    shape = (out["architecture"], out["num_kv_heads"], out["head_dim"], out["num_heads"])
    assert shape == ("mistral", 2, 16, 4) and (out["sliding_window"], out["sliding_layers"]) == (40, 2)
    # every layer slides, and 30 tokens fit the window: keeping only the window holds them all
    every_block = 30 * 2 * 2 * 2 * 16 * 2  # tokens x K|V x layers x KV heads x head_dim x 2 bytes
    assert out["bytes_per_sequence"] == every_block
    kept, window_only = out["sliding_bytes_per_sequence_kept"], out["sliding_bytes_per_sequence_window_only"]
    assert kept == window_only == every_block


def test_a_model_without_a_window_says_every_layer_attends_the_whole_context(tiny_model_dir, capsys):
    assert cli.main(["plan", "--model", str(tiny_model_dir), "--tokens", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["model: llama, 2 layers, 4 query heads, 2 KV heads, head_dim 16",
                         "  every layer attends the whole context"]
    assert cli.main(["plan", "--model", str(tiny_model_dir), "--tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["architecture"] == "llama" and "sliding_window" not in out


def test_plan_takes_a_models_name(capsys):
    assert cli.main(["plan", "--model", "smollm2", "--tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    shape = (out["architecture"], out["num_layers"], out["num_kv_heads"], out["head_dim"])
    assert shape == ("llama", 30, 3, 64)


@pytest.mark.parametrize("tokens, kept_tokens", [(4096, 512), (100, 100)])
def test_gemma3_270m_shape_arithmetic(tokens, kept_tokens):
    # Gemma 3 270M: 18 layers, 1 KV head of 256, a 512-token window on all but every 6th layer
    config = ModelConfig(vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_layers=18,
                         num_heads=4, num_kv_heads=1, head_dim=256, max_position_embeddings=32_768,
                         architecture="gemma3", sliding_window=512,
                         sliding_layers=tuple(i for i in range(18) if (i + 1) % 6))
    window = family_plan(config, "bfloat16", tokens).window
    assert (window.sliding_layers, window.window) == (15, 512)
    assert window.bytes_kept == 2 * 15 * 256 * 2 * tokens
    assert window.bytes_window_only == 2 * 15 * 256 * 2 * kept_tokens
