"""A request that sets no temperature, top_p or top_k samples with the served model's defaults.

Through a real router and real workers (tests/helpers/cluster.py) on the tiny model with a
generation_config.json: a seeded request's tokens are exactly those of one in-process engine run
with the model's values set explicitly (same seed), whether it prefills on a prefill worker or on
the decode worker. The router's defaults are what `pdserve up` computes (deploy/launcher.py
sampling_defaults_in_force); a request's own value wins field by field, and temperature 0 is
greedy whatever the defaults. Every flow ends with the leak check.
"""

from __future__ import annotations

import json
import shutil

import pytest

from deploy.config import ClusterSpec
from deploy.launcher import sampling_defaults_in_force
from pdserve.engine.sampling_defaults import SamplingDefaults, SamplingOverrides
from pdserve.engine.sequence import SamplingParams
from pdserve.engine.weights import LoadedModel, load_model
from pdserve.worker.convert import sampling_with_defaults
from protos.pdserve.v1 import generation_pb2 as pb
from tests.conftest import assert_no_leaks, make_engine
from tests.helpers.cluster import generate, running_cluster, start_router
from tests.helpers.workers import wait_until_clean

GENERATION_CONFIG = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_id": 2}
MODEL_DEFAULTS = SamplingDefaults(0.7, 0.8, 20, "generation_config.json")
SEED, MAX_TOKENS = 1234, 8
# least_load: 50 uncached tokens prefill on the prefill worker (KV and RNG state move to D), 10 on D
PROMPTS = {"remote prefill": list(range(700, 750)), "prefill on decode": list(range(900, 910))}


@pytest.fixture(scope="module")
def loaded(tiny_model_dir, tmp_path_factory) -> LoadedModel:
    folder = tmp_path_factory.mktemp("tiny-with-generation-config") / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return load_model(str(folder), progress=False)


@pytest.fixture(scope="module")
def cluster(loaded):
    with running_cluster(loaded, sampling_defaults=sampling_defaults_in_force(loaded, ClusterSpec())) as c:
        yield c


def request(prompt: list[int], **sampling) -> pb.GenerateRequest:
    """Seeded, MAX_TOKENS tokens; only the sampling fields given are set."""
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        seed=SEED, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling))


def routed_tokens(router, prompt: list[int], **sampling) -> tuple[list[int], str]:
    replies = generate(router, request(prompt, **sampling))
    return [t for r in replies for t in r.token_ids], replies[-1].prefill_worker


def engine_tokens(loaded: LoadedModel, prompt: list[int], temperature: float, top_p: float,
                  top_k: int) -> list[int]:
    """One in-process engine, every sampling value explicit, the same seed."""
    engine = make_engine(loaded)
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=SEED,
                              max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = engine.generate([prompt], sampling, detokenize=False)[0].token_ids
    assert_no_leaks(engine)
    return tokens


def test_only_the_fields_a_request_left_unset_take_the_defaults():
    asked = pb.SamplingParams(temperature=0, seed=7, max_tokens=3, stop=["x"])
    filled = sampling_with_defaults(asked, MODEL_DEFAULTS)
    assert (filled.temperature, filled.top_k) == (0, 20) and filled.top_p == pytest.approx(0.8)
    assert (filled.seed, filled.max_tokens, list(filled.stop)) == (7, 3, ["x"])
    assert not asked.HasField("top_p")  # the request itself is left as it came


def test_the_router_serves_the_models_generation_config(cluster, loaded):
    assert loaded.sampling_defaults == MODEL_DEFAULTS
    assert cluster.router.sampling_defaults == MODEL_DEFAULTS


@pytest.mark.parametrize("path", PROMPTS)
def test_no_sampling_fields_means_the_models_defaults(cluster, loaded, path):
    prompt = PROMPTS[path]
    tokens, prefill_worker = routed_tokens(cluster.router, prompt)
    assert bool(prefill_worker) is (path == "remote prefill")
    assert tokens == engine_tokens(loaded, prompt, temperature=0.7, top_p=0.8, top_k=20)
    # the test can tell: the neutral 1.0 / 1.0 / 0 draw other tokens from the same seed
    assert tokens != engine_tokens(loaded, prompt, temperature=1.0, top_p=1.0, top_k=0)
    wait_until_clean(*cluster.workers)


@pytest.mark.parametrize("path", PROMPTS)
def test_a_requests_own_values_win_field_by_field(cluster, loaded, path):
    prompt = PROMPTS[path]
    tokens, _ = routed_tokens(cluster.router, prompt, temperature=1.0, top_k=0)
    assert tokens == engine_tokens(loaded, prompt, temperature=1.0, top_p=0.8, top_k=0)
    greedy, _ = routed_tokens(cluster.router, prompt, temperature=0)
    assert greedy == engine_tokens(loaded, prompt, temperature=0, top_p=1.0, top_k=0)
    wait_until_clean(*cluster.workers)


def test_up_flags_override_the_models_defaults(cluster, loaded):
    spec = ClusterSpec(sampling_overrides=SamplingOverrides(temperature=0.0))
    defaults = sampling_defaults_in_force(loaded, spec)
    assert defaults == SamplingDefaults(0.0, 0.8, 20, "flags/config over generation_config.json")
    router = start_router(loaded, cluster.records, sampling_defaults=defaults)
    try:
        assert router.sampling_defaults == defaults
        prompt = PROMPTS["remote prefill"]
        tokens, _ = routed_tokens(router, prompt)
        assert tokens == engine_tokens(loaded, prompt, temperature=0, top_p=1.0, top_k=0)
    finally:
        router.stop()
    wait_until_clean(*cluster.workers)
