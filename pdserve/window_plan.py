"""What `pdserve plan --model` says beyond the KV arithmetic of pdserve/plan.py: the model's family,
its attention shape and, for a model whose layers attend within a sliding window (Gemma 3's local
layers, a windowed Mistral's), what those layers' KV would come to if only the window were kept.

    per sequence of T tokens, the sliding layers' KV:
        kept today   = 2 x sliding layers x kv_heads x row bytes x T            (every block is kept)
        window only  = 2 x sliding layers x kv_heads x row bytes x min(T, W)    (the last W tokens)

NOTE: the engine keeps every block of every layer (pdserve/engine/block_pool.py), windowed or not;
the second figure is what a window-aware pool could hold instead, not what runs.

The arithmetic is pure; read_model_config reads the config the way the loaders do (torch loads).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.config import ModelConfig, kv_bytes_per_token
from pdserve.plan import gguf_reader


@dataclass(frozen=True)
class WindowPlan:
    """The sliding layers of a model and their KV for one sequence of `tokens` tokens."""

    window: int  # tokens a query of a sliding layer attends, itself included
    sliding_layers: int
    num_layers: int
    tokens: int
    bytes_kept: int  # the sliding layers' KV per sequence, every block kept (as pdserve does)
    bytes_window_only: int  # the same layers' KV if only their last `window` tokens were kept

    @property
    def tokens_in_window(self) -> int:
        return min(self.tokens, self.window)


@dataclass(frozen=True)
class FamilyPlan:
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: WindowPlan | None  # None: every layer attends the whole context

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"architecture": self.architecture, "num_heads": self.num_heads}
        if self.window is not None:
            w = self.window
            out |= {"sliding_window": w.window, "sliding_layers": w.sliding_layers,
                    "sliding_bytes_per_sequence_kept": w.bytes_kept,
                    "sliding_bytes_per_sequence_window_only": w.bytes_window_only}
        return out

    def describe(self) -> list[str]:
        lines = [f"model: {self.architecture}, {self.num_layers} layers, {self.num_heads} query heads, "
                 f"{self.num_kv_heads} KV heads, head_dim {self.head_dim}"]
        w = self.window
        if w is None:
            return lines + ["  every layer attends the whole context"]
        return lines + [
            f"  sliding window: {w.sliding_layers} of {w.num_layers} layers attend within the last "
            f"{w.window:,} tokens",
            f"  their KV per sequence: {w.bytes_kept:,} B for {w.tokens:,} tokens, as pdserve keeps every "
            f"block today; {w.bytes_window_only:,} B if only the window ({w.tokens_in_window:,} tokens) "
            "were kept"]


def family_plan(config: ModelConfig, dtype: str, tokens: int) -> FamilyPlan:
    """The family, the attention shape and the window arithmetic of the module docstring."""
    window = None
    sliding = len(config.sliding_layers)
    if config.sliding_window is not None and sliding:
        per_token = kv_bytes_per_token(sliding, config.num_kv_heads, config.head_dim, dtype)
        window = WindowPlan(config.sliding_window, sliding, config.num_layers, tokens, per_token * tokens,
                            per_token * min(tokens, config.sliding_window))
    return FamilyPlan(config.architecture, config.num_layers, config.num_heads, config.num_kv_heads,
                      config.head_dim, window)


def read_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig the loaders would build for a Hugging Face folder or a .gguf file, without
    its weights (a GGUF's eos ids from its metadata, not its tokenizer)."""
    p = Path(path)
    if p.is_dir():
        from pdserve.engine.tokenizer import Tokenizer, read_json_file
        from pdserve.engine.weights import hf_model_config

        return hf_model_config(read_json_file(p / "config.json"), Tokenizer.from_files(p), source=p)
    from pdserve.engine.gguf_weights import _cache_entry, gguf_model_config
    from pdserve.engine.tokenizer import read_gguf_metadata
    from pdserve.engine.weights import default_cache_dir

    # NOTE: a GGUF loaded before has its config in the converted-weights cache; reading a file's
    # metadata parses its whole vocabulary (about 20 s for Gemma 3's 262,144 tokens).
    meta = _cache_entry(p, default_cache_dir()) / "meta.json"
    try:
        return ModelConfig(**json.loads(meta.read_text())["config"])
    except (OSError, ValueError, TypeError, KeyError):  # none yet, or another version's
        pass
    reader = gguf_reader(p.resolve())
    tied = all(tensor.name != "output.weight" for tensor in reader.tensors)
    return gguf_model_config(read_gguf_metadata(reader), None, tied=tied, source=p)
