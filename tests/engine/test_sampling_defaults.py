"""The model's sampling defaults: read from generation_config.json, SmolLM2's model card, flags over both."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from pdserve.engine.gguf_weights import gguf_sampling_defaults
from pdserve.engine.sampling_defaults import (
    NEUTRAL,
    SMOLLM2_MODEL_CARD,
    SamplingDefaults,
    SamplingOverrides,
    from_generation_config,
)
from pdserve.engine.weights import default_model_path, load_model
from pdserve.field_error import FieldError


def tiny_with_generation_config(tiny_model_dir: Path, target: Path, generation: dict) -> Path:
    shutil.copytree(tiny_model_dir, target)
    (target / "generation_config.json").write_text(json.dumps(generation))
    return target


# --- generation_config.json ---------------------------------------------------------------------
def test_an_hf_folder_takes_its_generation_configs_values(tmp_path, tiny_model_dir):
    folder = tiny_with_generation_config(tiny_model_dir, tmp_path / "m", {
        "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": 2})
    loaded = load_model(str(folder), progress=False)
    assert loaded.sampling_defaults == SamplingDefaults(0.6, 0.9, 20, "generation_config.json")


def test_an_hf_folder_without_generation_config_is_neutral(tiny_loaded):
    assert tiny_loaded.sampling_defaults == NEUTRAL == SamplingDefaults(1.0, 1.0, 0)


@pytest.mark.parametrize("generation, expected", [
    ({"eos_token_id": 2}, NEUTRAL),  # names no sampling value: the neutral ones
    ({"temperature": 0.7}, SamplingDefaults(0.7, 1.0, 0, "generation_config.json")),
    ({"top_p": 0.95, "top_k": None}, SamplingDefaults(1.0, 0.95, 0, "generation_config.json")),
    ({"temperature": 1, "top_k": 50.0}, SamplingDefaults(1.0, 1.0, 50, "generation_config.json")),
    # transformers' generate() is greedy under do_sample false, whatever the temperature says
    ({"do_sample": False, "temperature": 0.6, "top_p": 0.9},
     SamplingDefaults(0.0, 0.9, 0, "generation_config.json")),
    ({"do_sample": True}, NEUTRAL),
])
def test_missing_keys_keep_the_neutral_value(generation, expected):
    assert from_generation_config(generation) == expected


def test_json_ints_become_floats_and_whole_floats_ints():
    d = from_generation_config({"temperature": 1, "top_p": 1, "top_k": 40.0})
    assert (type(d.temperature), type(d.top_p), type(d.top_k)) == (float, float, int)


def test_a_bad_value_in_generation_config_names_the_file_and_the_key(tmp_path, tiny_model_dir):
    folder = tiny_with_generation_config(tiny_model_dir, tmp_path / "m", {"top_p": 0})
    with pytest.raises(ValueError) as error:
        load_model(str(folder), progress=False)
    assert str(error.value) == (f"{folder}/generation_config.json: top_p must be in (0, 1] (1 = off), "
                                "got 0.0; fix the file, or override it with pdserve up --default-top-p")


@pytest.mark.parametrize("generation, field", [
    ({"temperature": -0.5}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": "0.7"}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"),
])
def test_out_of_range_values_are_refused_with_the_field(generation, field):
    with pytest.raises(FieldError) as error:
        from_generation_config(generation)
    assert error.value.field == field


# --- the embedded SmolLM2 -----------------------------------------------------------------------
def test_the_embedded_smollm2_gets_its_model_cards_values():
    assert gguf_sampling_defaults(Path(default_model_path())) == SMOLLM2_MODEL_CARD
    assert SMOLLM2_MODEL_CARD == SamplingDefaults(0.2, 0.9, 0, "SmolLM2 model card")


def test_any_other_gguf_is_neutral(tmp_path):
    assert gguf_sampling_defaults(tmp_path / "other-model.gguf") == NEUTRAL


# --- flags over the model's ---------------------------------------------------------------------
def test_flags_replace_the_values_they_give_and_say_so():
    assert SMOLLM2_MODEL_CARD.overridden_by(SamplingOverrides()) is SMOLLM2_MODEL_CARD
    some = SMOLLM2_MODEL_CARD.overridden_by(SamplingOverrides(top_k=40))
    assert some == SamplingDefaults(0.2, 0.9, 40, "flags/config over SmolLM2 model card")
    every = SMOLLM2_MODEL_CARD.overridden_by(SamplingOverrides(temperature=0.0, top_p=1.0, top_k=0))
    assert every == SamplingDefaults(0.0, 1.0, 0, "flags/config")


@pytest.mark.parametrize("overrides, message", [
    ({"temperature": -1.0}, "temperature must be finite and >= 0 (0 = greedy), got -1.0"),
    ({"temperature": math.nan}, "temperature must be finite and >= 0 (0 = greedy), got nan"),
    ({"top_p": 0.0}, "top_p must be in (0, 1] (1 = off), got 0.0"),
    ({"top_k": -3}, "top_k must be >= 0 (0 = off), got -3"),
])
def test_bad_overrides_are_refused_naming_the_field(overrides, message):
    with pytest.raises(FieldError) as error:
        SamplingOverrides(**overrides)
    assert str(error.value) == message


def test_the_defaults_describe_themselves_for_the_banner_and_v1_models():
    assert SMOLLM2_MODEL_CARD.describe() == "temperature 0.2, top_p 0.9, top_k 0 (SmolLM2 model card)"
    assert SMOLLM2_MODEL_CARD.as_dict() == {"temperature": 0.2, "top_p": 0.9, "top_k": 0,
                                            "source": "SmolLM2 model card"}
