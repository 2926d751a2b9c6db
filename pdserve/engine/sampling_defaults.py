"""The sampling a request gets when it leaves temperature, top_p or top_k unset: the served model's.

    HF folder's generation_config.json ─┐
    a named model's published values ───┼─▶ LoadedModel.sampling_defaults
    (engine/named_models.py)            │        │
    any other model: NEUTRAL (1.0/1.0/0)┘        │
                                                 ▼  overridden_by(`pdserve up --default-*`)
                                     RouterConfig.sampling_defaults ─▶ every request's unset fields

A request's own value always wins, 0 (greedy) included. Pure: no I/O; the loader
(engine/weights.py) reads the file and hands its mapping to from_generation_config.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from pdserve.field_error import FieldError
from pdserve.settings import setting

# field -> (what a value must satisfy, how the requirement reads in an error)
_REQUIREMENTS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (lambda v: math.isfinite(v) and v >= 0, "must be finite and >= 0 (0 = greedy)"),
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1] (1 = off)"),
    "top_k": (lambda v: v >= 0, "must be >= 0 (0 = off)"),
}
SAMPLING_FIELDS = tuple(_REQUIREMENTS)


def check_sampling_value(name: str, value: float | int) -> None:
    """FieldError naming the field when value is out of its range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(name, "must be a number", value)
    if name == "top_k" and not isinstance(value, int):
        raise FieldError(name, "must be a whole number", value)
    holds, requirement = _REQUIREMENTS[name]
    if not holds(value):
        raise FieldError(name, requirement, value)


@dataclass(frozen=True)
class SamplingDefaults:
    """What an unset sampling field of a request becomes, and where the values came from."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    source: str = "pdserve neutral (the model names none)"

    def __post_init__(self) -> None:
        for name in SAMPLING_FIELDS:
            check_sampling_value(name, getattr(self, name))

    def overridden_by(self, overrides: SamplingOverrides) -> SamplingDefaults:
        """These defaults with the values an operator gave in their place."""
        given = overrides.given()
        if not given:
            return self
        source = "flags/config" if len(given) == len(SAMPLING_FIELDS) else f"flags/config over {self.source}"
        return replace(self, **given, source=source)

    def describe(self) -> str:
        return f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {self.top_k} ({self.source})"

    def as_dict(self) -> dict[str, float | int | str]:
        """The values and their source, as /v1/models lists them."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class SamplingOverrides:
    """What a request that leaves temperature, top_p or top_k unset gets in place of the model's default
    (its generation_config.json, where do_sample false = greedy; for the embedded SmolLM2 its model
    card's; else 1.0 / 1.0 / 0 = off). A request's own value always wins, 0 = greedy included; None
    keeps the model's value. `pdserve up` prints the defaults in force."""

    temperature: float | None = setting(None, flag="--default-temperature", key="default_temperature",
                                        metavar="T", help="default sampling temperature, finite and >= 0; "
                                                          "0 = greedy (default: the model's)")
    top_p: float | None = setting(None, flag="--default-top-p", key="default_top_p", metavar="P",
                                  help="default nucleus sampling: the smallest set of tokens whose "
                                       "probability reaches P, in (0, 1]; 1 = off (default: the model's)")
    top_k: int | None = setting(None, flag="--default-top-k", key="default_top_k", metavar="K",
                                help="default top-k: sample only from the K most likely tokens, >= 0; "
                                     "0 = off (default: the model's)")

    def __post_init__(self) -> None:
        for name, value in self.given().items():
            check_sampling_value(name, value)

    def given(self) -> dict[str, float | int]:
        return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}


NEUTRAL = SamplingDefaults()

# The SmolLM2-135M-Instruct model card on Hugging Face (HuggingFaceTB/SmolLM2-135M-Instruct)
# recommends these in its usage example: model.generate(..., temperature=0.2, top_p=0.9,
# do_sample=True). Its GGUF carries no generation config, and at 1.0 with no top-p a 135M model
# answers "What is 2+2?" with word salad.
SMOLLM2_MODEL_CARD = SamplingDefaults(temperature=0.2, top_p=0.9, top_k=0, source="SmolLM2 model card")

# Gemma 3 270M's generation_config.json on Hugging Face (google/gemma-3-270m): do_sample true, top_k 64,
# top_p 0.95 and no temperature (so 1.0). Its GGUF carries none of it.
GEMMA3_270M_GENERATION_CONFIG = SamplingDefaults(temperature=1.0, top_p=0.95, top_k=64,
                                                 source="Gemma 3 270M generation_config.json")


def from_generation_config(generation: Mapping[str, Any],
                           source: str = "generation_config.json") -> SamplingDefaults:
    """The defaults a Hugging Face generation_config.json names; a key it leaves out (or null) keeps
    the neutral value, and a file naming none of them gives NEUTRAL. FieldError names a bad key.

    NOTE: an explicit `do_sample: false` means greedy (temperature 0), as transformers' generate()
    reads it; vLLM reads only the values and ignores do_sample. A missing do_sample is not taken
    as false (transformers' own default), or every file that only lists eos ids would be greedy.
    """
    values = {name: _json_number(name, generation[name]) for name in SAMPLING_FIELDS
              if generation.get(name) is not None}
    if generation.get("do_sample") is False:
        values["temperature"] = 0.0
    if not values:
        return NEUTRAL
    return SamplingDefaults(**values, source=source)


def _json_number(name: str, value: Any) -> Any:
    """JSON's 1 as 1.0 for the float fields, 50.0 as 50 for top_k; anything else is checked as it is."""
    if isinstance(value, bool):
        return value
    if name == "top_k" and isinstance(value, float) and value.is_integer():
        return int(value)
    if name != "top_k" and isinstance(value, int):
        return float(value)
    return value
