"""`pdserve plan --gpu-memory-gib`: the pool a worker on a GPU sizes for itself (vLLM's rule,
pdserve/engine/config.py gpu_pool_blocks), and the dtypes' auto resolved as on that GPU."""

from __future__ import annotations

import json

import pytest

from deploy import cli
from pdserve.engine.config import activation_reserve_bytes, gpu_pool_blocks
from pdserve.plan import plan_gpu_pool, read_weight_plan
from pdserve.window_plan import read_model_config

GIB = 2**30


def plan_json(capsys, *argv: str) -> dict:
    assert cli.main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_gpu_plan_is_bfloat16_and_counts_the_blocks_by_the_engines_rule(capsys, tiny_model_dir):
    out = plan_json(capsys, "--model", str(tiny_model_dir), "--tokens", "64", "--gpu-memory-gib", "2")
    config, weights = read_model_config(tiny_model_dir), read_weight_plan(tiny_model_dir)
    assert out["dtype"] == out["model_dtype"] == "bfloat16"
    assert out["gpu_weight_bytes"] == 2 * weights.parameters  # untied: each parameter once, 2 bytes
    reserve = activation_reserve_bytes(config, 2048, 64, "bfloat16")
    block_bytes = config.kv_bytes_per_token("bfloat16") * 16
    assert out["gpu_activation_reserve_bytes"] == reserve
    assert out["gpu_num_blocks"] == gpu_pool_blocks(2 * GIB - out["gpu_weight_bytes"], 2 * GIB, 0.9,
                                                    block_bytes, reserve)
    assert out["gpu_tokens"] == 16 * out["gpu_num_blocks"]


def test_explicit_dtypes_and_utilization_are_kept(capsys, tiny_model_dir):
    base = ["--model", str(tiny_model_dir), "--tokens", "64", "--gpu-memory-gib", "2"]
    bf16 = plan_json(capsys, *base)
    half = plan_json(capsys, *base, "--gpu-memory-utilization", "0.5")
    fp32 = plan_json(capsys, *base, "--model-dtype", "float32", "--dtype", "int8", "--block-size", "32")
    assert half["gpu_num_blocks"] < bf16["gpu_num_blocks"]
    assert (fp32["model_dtype"], fp32["dtype"], fp32["block_size"]) == ("float32", "int8", 32)
    assert fp32["gpu_weight_bytes"] == 2 * bf16["gpu_weight_bytes"]


def test_without_a_gpu_the_plan_is_the_cpus_as_before(capsys, tiny_model_dir):
    out = plan_json(capsys, "--model", str(tiny_model_dir), "--tokens", "64")
    assert out["dtype"] == "float32" and "gpu_num_blocks" not in out


def test_the_table_shows_the_rule_and_the_resolved_dtypes(capsys, tiny_model_dir):
    assert cli.main(["plan", "--model", str(tiny_model_dir), "--tokens", "64", "--gpu-memory-gib", "2"]) == 0
    out = capsys.readouterr().out
    assert "dtype bfloat16 (auto: cuda), kv_dtype bfloat16 (auto: the model's dtype)" in out
    assert "GPU pool: on a GPU of 2 GiB at gpu_memory_utilization 0.9: 1.80 GiB - " in out
    assert " activation reserve -> " in out and " blocks of 16 tokens (" in out
    assert "weights: " not in out  # the float32 CPU line: the GPU line counts them in bfloat16


@pytest.mark.parametrize(("argv", "message"), [
    (["--layers", "2", "--kv-heads", "1", "--head-dim", "32", "--gpu-memory-gib", "8"],
     "--gpu-memory-gib needs --model"),
    (["--gpu-memory-gib", "8", "--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
    (["--gpu-memory-gib", "0.25"], "no GPU memory left for the KV cache"),
])
def test_a_gpu_plan_that_cannot_be_made_says_why(capsys, tiny_model_dir, argv, message):
    model = [] if "--layers" in argv else ["--model", str(tiny_model_dir)]
    assert cli.main(["plan", *model, "--tokens", "64", *argv]) == 2
    assert message in capsys.readouterr().err


def test_plan_gpu_pool_counts_a_tied_models_table_beside_its_head(tiny_model_dir):
    config, weights = read_model_config(tiny_model_dir), read_weight_plan(tiny_model_dir)
    tied = type(weights)(weights.parameters, 4 * 1000)
    plan = plan_gpu_pool(config, tied, "bfloat16", "bfloat16", 2.0, 0.9, 16, 2048, 64)
    assert plan.weight_bytes == 2 * weights.parameters + 2 * 1000
