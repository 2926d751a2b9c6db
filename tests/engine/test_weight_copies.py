"""One copy of each weight: the model keeps its kernel's prepared copies only, never the weights as
loaded (pdserve/engine/model.py), and a tied model on the native kernel reads its embedding rows out of
the lm_head's panels instead of keeping a table beside them."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pdserve.engine.model import EmbeddingTable
from pdserve.engine.sequence import SamplingParams
from pdserve.engine.tiny_model import write_tiny_model
from pdserve.engine.weights import load_model
from tests.conftest import TORCH_KERNELS, make_engine
from tests.engine.kernel_checks import check_cache_paths, needs_kernel


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory, tiny_loaded):
    return write_tiny_model(tmp_path_factory.mktemp("tied-llama"), seed=3, tie_word_embeddings=True,
                            tokenizer=tiny_loaded.tokenizer)


@pytest.mark.parametrize("kernels", [pytest.param({}, marks=needs_kernel, id="defaults"),
                                     pytest.param(TORCH_KERNELS, id="torch")])
def test_no_weight_as_loaded_outlives_the_loaded_model(tied_model_dir, kernels):
    """Every tensor the loader made is freed with the LoadedModel: the engine keeps copies of its own
    (a kept loader tensor can keep a whole mapped weights file resident)."""
    loaded = load_model(str(tied_model_dir), progress=False)
    alive = [weakref.ref(tensor) for tensor in loaded.state_dict.values()]
    engine = make_engine(loaded, **kernels)
    del loaded
    gc.collect()
    assert [ref for ref in alive if ref() is not None] == []
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert engine.generate([[1, 2, 3]], greedy, detokenize=False)[0].token_ids


@needs_kernel
def test_a_tied_model_on_native_keeps_its_embedding_once_in_the_heads_panels(tied_model_dir):
    loaded = load_model(str(tied_model_dir), progress=False)
    engine = make_engine(loaded)
    assert engine.model.embed == EmbeddingTable(None, engine.model.lm_head)
    ids = torch.tensor([0, 5, loaded.config.vocab_size - 1])
    assert torch.equal(engine.model.embed.rows(ids), loaded.state_dict["model.embed_tokens.weight"][ids])
    check_cache_paths(engine)


def test_a_tied_model_on_matmul_keeps_a_table_of_its_own(tied_model_dir):
    engine = make_engine(load_model(str(tied_model_dir), progress=False), **TORCH_KERNELS)
    assert engine.model.embed.table is not None and engine.model.embed.head is None

