"""The converted-weights cache gives back exactly what a fresh GGUF load gives."""

from __future__ import annotations

import time

import torch

from pdserve.engine.sampling_defaults import SMOLLM2_MODEL_CARD
from pdserve.engine.weights import load_model


def test_cached_load_is_identical_and_fast(tmp_path, smollm_loaded):
    first = load_model(None, progress=False, cache_dir=tmp_path)  # converts and writes the cache
    started = time.perf_counter()
    cached = load_model(None, progress=False, cache_dir=tmp_path)
    elapsed = time.perf_counter() - started
    for loaded in (first, cached):
        assert loaded.fingerprint == smollm_loaded.fingerprint
        assert loaded.config == smollm_loaded.config
        assert loaded.source == smollm_loaded.source
        assert loaded.sampling_defaults == smollm_loaded.sampling_defaults == SMOLLM2_MODEL_CARD
    assert all(torch.equal(cached.state_dict[k], v) for k, v in smollm_loaded.state_dict.items())
    text = "Prices: 12,345.67 €  —  naïve 数字\t\n<|im_start|>user\nhi<|im_end|>"
    assert cached.tokenizer.encode(text) == smollm_loaded.tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    expected = smollm_loaded.tokenizer.apply_chat_template(messages)
    assert cached.tokenizer.apply_chat_template(messages) == expected
    assert elapsed < 10  # the point of the cache; a GGUF dequantise takes ~11 s on 2 cores


def test_a_corrupt_cache_entry_is_ignored(tmp_path, smollm_loaded):
    load_model(None, progress=False, cache_dir=tmp_path)
    [meta] = list(tmp_path.glob("gguf/*/meta.json"))
    meta.write_text(meta.read_text().replace(smollm_loaded.fingerprint, "0" * 64))
    again = load_model(None, progress=False, cache_dir=tmp_path)
    assert again.fingerprint == smollm_loaded.fingerprint
