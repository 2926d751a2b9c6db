"""Two model families never share KV, even made of the same bytes.

The mistral twin below is the session's tiny llama checkpoint with only config.json's family changed
(model_type, architectures, no window): same tensors, same tokenizer, and, as Mistral without a window
is Llama's forward pass, the same KV. Nothing but the family's name keeps the two apart, so the name
must reach the fingerprint, the engine salt (every block hash) and the KV transfer's layout handshake.
"""

from __future__ import annotations

import json
import shutil

import grpc
import pytest
import torch

from pdserve.engine.families import FAMILIES
from pdserve.engine.hashing import engine_salt, hash_blocks
from pdserve.engine.weights import load_model
from pdserve.kvwire import KVLayout
from tests.conftest import make_engine
from tests.helpers.rig import (
    CHANNELS,
    assert_no_wrong_kv,
    cached_prompt_blocks,
    reference_tokens,
    start_rig,
)
from tests.helpers.workers import wait_until_clean

PROMPT = list(range(300, 350))  # 50 tokens: 3 full blocks of 16 and a partial one


@pytest.fixture(scope="module")
def mistral_twin(tmp_path_factory, tiny_model_dir):
    """The tiny llama checkpoint (tiny_loaded's) relabelled as Mistral: same bytes, other family."""
    directory = tmp_path_factory.mktemp("tiny-mistral-twin") / "model"
    shutil.copytree(tiny_model_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return load_model(str(directory), progress=False)


def test_the_twin_is_the_same_bytes_of_another_family(tiny_loaded, mistral_twin):
    assert (tiny_loaded.config.architecture, mistral_twin.config.architecture) == ("llama", "mistral")
    assert mistral_twin.state_dict.keys() == tiny_loaded.state_dict.keys()
    assert all(torch.equal(mistral_twin.state_dict[k], v) for k, v in tiny_loaded.state_dict.items())
    assert mistral_twin.tokenizer.fingerprint() == tiny_loaded.tokenizer.fingerprint()


def test_same_bytes_other_family_gives_other_fingerprint_salt_and_block_hashes(tiny_loaded, mistral_twin):
    llama, mistral = make_engine(tiny_loaded), make_engine(mistral_twin)
    assert llama.fingerprint != mistral.fingerprint
    assert llama.salt != mistral.salt
    llama_hashes, mistral_hashes = (hash_blocks(PROMPT, 16, e.salt) for e in (llama, mistral))
    assert len(llama_hashes) == len(mistral_hashes) == 3
    assert not set(llama_hashes) & set(mistral_hashes)  # no block of one is ever a block of the other


def test_the_salt_names_the_family_even_for_one_fingerprint():
    """Should two families ever compute one fingerprint, their block hashes still differ."""
    salts = {engine_salt("f" * 64, 16, "float32", architecture=name) for name in FAMILIES}
    assert len(salts) == len(FAMILIES)
    assert engine_salt("f" * 64, 16, "float32") == engine_salt("f" * 64, 16, "float32", architecture="llama")


def test_a_worker_layout_carries_its_family(tiny_loaded, mistral_twin):
    engine = make_engine(mistral_twin, num_blocks=8)
    layout = KVLayout.of_cache(engine.kv_cache, engine.fingerprint, engine.model_config.architecture)
    assert layout.architecture == "mistral"
    assert KVLayout.from_dict(layout.to_msgpack_dict()) == layout
    llama = KVLayout.of_cache(engine.kv_cache, tiny_loaded.fingerprint, "llama")
    # the family is named first: it explains the fingerprint (and any shape) that differs with it
    assert layout.first_mismatch(llama) == "architecture: sender mistral, receiver llama"


def test_a_layout_from_a_peer_before_families_reads_as_llama():
    layout = KVLayout("f" * 64, 16, "float32", 2, 2, 16, architecture="mistral")
    legacy = layout.to_msgpack_dict()
    del legacy["architecture"]
    old = KVLayout.from_dict(legacy)
    assert old.architecture == "llama"  # the only family such a peer could run
    assert old.first_mismatch(layout) == "architecture: sender llama, receiver mistral"


@pytest.mark.parametrize("kind", CHANNELS)
@pytest.mark.parametrize("prefill_family", ["llama", "mistral"])
def test_a_transfer_between_families_fails_precondition_naming_the_architecture(
        tiny_loaded, mistral_twin, kind, prefill_family):
    models = {"llama": tiny_loaded, "mistral": mistral_twin}
    decode_family = "mistral" if prefill_family == "llama" else "llama"
    rig = start_rig(models[prefill_family], kind, decode_loaded=models[decode_family])
    try:
        with pytest.raises(grpc.RpcError) as failure:
            rig.remote_prefill("r1", PROMPT)
        assert failure.value.code() is grpc.StatusCode.FAILED_PRECONDITION, failure.value.details()
        named = f"architecture: sender {prefill_family}, receiver {decode_family}"
        assert named in failure.value.details(), failure.value.details()
        assert rig.decode.status().transfer_outcomes == {"FAILED_PRECONDITION": 1}
        assert cached_prompt_blocks(rig.decode, PROMPT) == 0
        # the refused request is answered by D's own prefill, exactly as its model alone answers it
        tokens, used = rig.decode_tokens("r1", PROMPT)
        assert not used and tokens == reference_tokens(models[decode_family], PROMPT)
        wait_until_clean(rig.prefill, rig.decode)
        assert_no_wrong_kv(rig.prefill, rig.decode)
    finally:
        rig.close()
