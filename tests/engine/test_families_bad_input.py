"""A model pdserve cannot run is refused at load, naming what and pointing to docs/models.md, and
a config that contradicts its weights is refused naming the tensor; no worker is built from it."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.weights import load_model
from pdserve.worker.server import WorkerConfig
from tests.helpers.workers import worker_server

SUPPORTED = "llama, mistral, qwen2, qwen3, gemma3"


@pytest.fixture
def edit_config(family_model, tmp_path):
    """A copy of a family's tiny twin with config.json changed: edit(arch, **fields) -> its path."""
    def edit(arch: str, **fields) -> str:
        source, _ = family_model(arch)
        target = tmp_path / f"{arch}-edited"
        shutil.copytree(source, target)
        raw = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps(raw | fields))
        return str(target)

    return edit


@pytest.mark.parametrize(("model_type", "named"), [
    ("qwen3_moe", "'qwen3_moe' is a mixture of experts"),
    ("mixtral", "'mixtral' is a mixture of experts"),
    ("qwen3_next", "'qwen3_next' is a hybrid with linear-attention layers"),
    ("mamba_llama", "'mamba_llama' is not a family pdserve knows"),
])
def test_an_architecture_pdserve_does_not_run_is_refused_naming_it(edit_config, model_type, named):
    with pytest.raises(ValueError) as refused:
        load_model(edit_config("llama", model_type=model_type), progress=False)
    message = str(refused.value)
    assert named in message and f"pdserve serves {SUPPORTED}" in message and "docs/models.md" in message


@pytest.mark.parametrize(("arch", "fields", "named"), [
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window is True"),
    ("mistral", {"hidden_act": "gelu"}, "hidden_act is 'gelu'; mistral runs silu"),
    ("llama", {"attention_bias": True}, "attention_bias is True; pdserve's llama has no biases"),
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping is 30.0"),
    ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor is not 1"),
])
def test_a_part_pdserve_would_compute_otherwise_is_refused_naming_the_field(edit_config, arch, fields, named):
    with pytest.raises(ValueError, match="config.json") as refused:
        load_model(edit_config(arch, **fields), progress=False)
    assert named in str(refused.value)


@pytest.mark.parametrize(("arch", "fields", "tensor"), [
    ("qwen3", {"head_dim": 16}, "model.layers.0.self_attn.q_proj.weight"),
    ("qwen2", {"num_key_value_heads": 4}, "model.layers.0.self_attn.k_proj.weight"),
    ("gemma3", {"intermediate_size": 96}, "model.layers.0.mlp.gate_proj.weight"),
])
def test_a_config_that_contradicts_the_weights_names_the_tensor(edit_config, arch, fields, tensor):
    with pytest.raises(ValueError, match=f"{tensor} has shape"):
        load_model(edit_config(arch, **fields), progress=False)


def test_no_worker_is_built_from_a_refused_model(edit_config):
    moe = edit_config("llama", model_type="qwen3_moe")
    config = WorkerConfig(worker_id="w-moe", role="decode", engine=EngineConfig(model_path=moe, device="cpu"))
    with pytest.raises(ValueError, match="mixture of experts"):
        worker_server(config)


def test_pdserve_up_refuses_the_model_before_it_starts_redis_ray_or_a_worker(edit_config):
    from deploy.config import ClusterSpec
    from deploy.launcher import LocalCluster

    moe = edit_config("llama", model_type="qwen3_moe")
    said: list[str] = []
    cluster = LocalCluster(ClusterSpec(engine=EngineConfig(model_path=moe)), say=said.append)
    with pytest.raises(ValueError, match="mixture of experts"):
        cluster.start()
    assert said == []  # not even the security line: the model is read first
    assert (cluster.redis_server, cluster.actors, cluster.router) == (None, {}, None)
    assert not cluster._started_ray
