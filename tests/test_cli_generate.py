"""`pdserve generate --local`: the real CLI, in a subprocess, on the real model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def pdserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_capital_of_france_is_paris():
    proc = pdserve("generate", "--local", "--temperature", "0", "--no-progress",
                   "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


@pytest.mark.slow
def test_jsonl_input_runs_in_one_engine_and_reuses_the_prefix(tmp_path):
    lines = [
        {"prompt": "Name three colours."},
        {"prompt": "Name three colours.", "max_tokens": 4},
        {"token_ids": [1, 2, 3], "max_tokens": 2},
        {"token_ids": [1, 10**7]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    proc = pdserve("generate", "--local", "--temperature", "0", "--max-tokens", "8", "--no-progress",
                   "--input", str(path))
    assert proc.returncode == 1  # one line failed, the others were served
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(out) == 5
    first, second, ids, bad, chat = out
    assert set(first) == {"text", "token_ids", "finish_reason", "usage"}
    assert first["usage"]["cached_tokens"] == 0
    assert second["usage"]["cached_tokens"] == 16 * ((second["usage"]["prompt_tokens"] - 1) // 16)
    assert second["token_ids"] == first["token_ids"][:4]
    assert len(ids["token_ids"]) == 2 and ids["usage"]["prompt_tokens"] == 3
    assert "outside the vocabulary" in bad["error"] and bad["line"] == 4
    assert chat["usage"]["completion_tokens"] >= 1


def test_local_sampling_flags_not_given_take_the_models_defaults():
    from deploy.cli import build_parser
    from pdserve.engine.sampling_defaults import SMOLLM2_MODEL_CARD
    from pdserve.generate_cli import sampling_from

    args = build_parser().parse_args(["generate", "--local", "--top-k", "5", "hi"])
    s = sampling_from(args, SMOLLM2_MODEL_CARD)
    assert (s.temperature, s.top_p, s.top_k) == (0.2, 0.9, 5)
    s = sampling_from(args, SMOLLM2_MODEL_CARD, {"temperature": 0})  # a JSONL line's own value
    assert (s.temperature, s.top_p, s.top_k) == (0, 0.9, 5)


def test_bad_flags_fail_fast_with_the_field_named(tiny_model_dir):
    proc = pdserve("generate", "--local", "--model", str(tiny_model_dir), "--top-p", "1.5", "hi")
    assert proc.returncode == 2
    assert "top_p must be in (0, 1], got 1.5" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = pdserve("generate", "--local", "--model", "/no/such/model", "hi")
    assert proc.returncode == 2 and "/no/such/model" in proc.stderr


def test_json_output_with_token_ids(tiny_model_dir):
    proc = pdserve("generate", "--local", "--model", str(tiny_model_dir), "--no-progress", "--json",
                   "--temperature", "0", "--max-tokens", "5", "--token-ids", "5,6,7")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 5
    assert result["usage"] == {"prompt_tokens": 3, "cached_tokens": 0, "computed_tokens": 3,
                               "completion_tokens": 5, "host_cached_tokens": 0, "disk_cached_tokens": 0}
