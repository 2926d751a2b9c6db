"""Each setting declared once (pdserve/settings.py): the declarations on ClusterSpec and its parts, and the
file reader and `pdserve up` flags built from them."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from deploy.cli import build_parser
from deploy.config import ClusterSpec, as_flags, load_config, with_overrides
from deploy.up import spec_from_args
from pdserve.engine.config import KERNEL_ALIASES, LINEAR_KERNELS, EngineConfig, normalize_kernel
from pdserve.field_error import FieldError
from pdserve.settings import compose, not_a_setting, setting, settings, walk

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "deploy" / "examples"
LEAVES = list(walk(ClusterSpec))
SETTINGS = settings(ClusterSpec)


def up_spec(*argv: str) -> ClusterSpec:
    return spec_from_args(build_parser().parse_args(["up", *argv]))


# --- the declarations ------------------------------------------------------------------------------

@pytest.mark.parametrize("leaf", LEAVES, ids=lambda leaf: leaf.path)
def test_every_field_is_a_setting_or_says_who_sets_it(leaf):
    assert (leaf.setting is None) != (not leaf.not_a_setting), leaf.path


@pytest.mark.parametrize("leaf", SETTINGS, ids=lambda leaf: leaf.path)
def test_every_setting_has_one_flag_and_one_key_or_says_why_not(leaf):
    s = leaf.setting
    assert s.key or s.flag_only
    assert s.flag or s.file_only
    assert s.help
    if s.file_only:  # a scalar always has a flag; only a mapping, which a flag cannot spell, goes without
        assert s.flag is None and leaf.accepted_types() == (dict,), leaf.path


def test_no_two_settings_share_a_flag_or_a_key():
    flags = [leaf.setting.flag for leaf in SETTINGS if leaf.setting.flag]
    flags += [leaf.setting.renamed_from[1] for leaf in SETTINGS if leaf.setting.renamed_from]
    assert len(flags) == len(set(flags))
    keys = [leaf.setting.key for leaf in SETTINGS if leaf.setting.key]
    renamed = [leaf.setting.renamed_from[0] for leaf in SETTINGS if leaf.setting.renamed_from]
    assert len(keys + renamed) == len(set(keys + renamed))
    sections = {key.split(".")[0] for key in keys if "." in key}
    assert not sections & set(keys)  # a section is never also a plain key


def test_every_setting_flag_is_a_flag_of_up():
    flags = {flag for action in _up_parser()._actions for flag in action.option_strings}
    assert {leaf.setting.flag for leaf in SETTINGS if leaf.setting.flag} <= flags


def test_a_kernel_takes_its_choices_and_its_check_from_the_engine():
    """deploy/ names no kernel: the flag takes what EngineConfig takes (its old aliases too) and refuses
    what it refuses, named by the key and the flag."""
    linear = next(leaf for leaf in SETTINGS if leaf.path == "engine.linear_kernel")
    assert linear.setting.choices == LINEAR_KERNELS
    for alias in KERNEL_ALIASES:
        assert up_spec("--linear-kernel", alias).engine.linear_kernel == normalize_kernel(alias)
    with pytest.raises(ValueError, match=r"^linear_kernel \(--linear-kernel\) must be one of "):
        up_spec("--linear-kernel", "mkl")


# --- file -> spec -> flags -----------------------------------------------------------------------

EVERY_FLAG_SET = """
    model: models/llama.gguf
    host: 0.0.0.0
    prefill: {count: 2, max_chunk_bytes: 1048576}
    decode: {count: 3}
    actor_placement: spread
    gpus_per_worker: 1
    torch_threads: 3
    dtype: bfloat16
    linear_kernel: matmul
    attention_kernel: sdpa
    pointwise_kernel: torch
    enforce_eager: true
    cache: {block_size: 32, kv_dtype: bfloat16, kv_cache_gib: 2.5, num_blocks: 1000, host_cache_gib: 1,
            gpu_memory_utilization: 0.8,
            disk_cache_dir: /var/kv, disk_cache_gib: 8}
    scheduler: {max_batched_tokens: 4096, max_num_seqs: 8}
    router: {count: 2, port: 50061, metrics_port: null, http_port: 0, served_model_name: llama,
             routing: least_load, min_remote_prefill_tokens: 8, max_in_flight_per_decode: 16,
             max_prompt_tokens: 1000, max_tokens_limit: 512, max_message_bytes: 65536,
             max_concurrent_streams: 32, cache_isolation: token, prefill_deadline_fraction: 0.25,
             prefill_timeout_s: 9.5, migration_limit: 0}
    redis_url: redis://:secret@10.0.0.1:6380/0
    ray_address: auto
    namespace: prod
    max_restarts: 5
    tls: {cert: c/server.pem, key: c/server-key.pem, ca: c/ca.pem, require_client_cert: true,
          client_cert: c/client.pem, client_key: c/client-key.pem}
    auth: {api_token_file: tokens.txt, cluster_secret_file: secret.txt}
    audit: {interval_s: 30, max_fraction: 0.1}
    default_temperature: 0.5
    default_top_p: 0.95
    default_top_k: 40
"""


def test_a_file_setting_every_flag_round_trips_through_the_flags(tmp_path):
    path = tmp_path / "every.yaml"
    path.write_text(textwrap.dedent(EVERY_FLAG_SET))
    spec = load_config(path)
    flags = as_flags(spec)
    assert up_spec(*flags) == spec
    missing = {leaf.setting.flag for leaf in SETTINGS if leaf.setting.flag} - set(flags)
    assert not missing, f"give {missing} a value other than the default in EVERY_FLAG_SET"


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_round_trips_through_the_flags_but_its_mappings(example):
    spec = load_config(EXAMPLES / example)
    file_only = {leaf.path: leaf.default for leaf in SETTINGS if leaf.setting.file_only}
    without_mappings = with_overrides(spec, file_only)
    assert up_spec(*as_flags(without_mappings)) == without_mappings


def test_a_mapping_cannot_be_spelled_as_flags():
    with pytest.raises(ValueError, match=r"^prefill.resources is set only in a file \(a mapping"):
        as_flags(ClusterSpec(prefill_resources={"prefill": 1.0}))


# --- the helpers, on a tree of their own ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Inner:
    size: int = setting(1, flag="--size", key="inner.size", help="how big")

    def __post_init__(self) -> None:
        if self.size < 1:
            raise FieldError("size", "must be >= 1", self.size)


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner = dataclasses.field(default_factory=Inner)
    name: str = setting("a", flag="--name", key="name", help="what it is called")
    debug: bool = not_a_setting(False, why="tests only")


def test_walk_goes_into_parts_and_reports_each_leaf_in_field_order():
    assert [(leaf.path, leaf.setting is not None) for leaf in walk(Outer)] == [
        ("inner.size", True), ("name", True), ("debug", False)]


def test_compose_rebuilds_each_part_and_names_a_refused_value_by_its_path():
    assert compose(Outer(), {"inner.size": 3, "name": "b"}) == Outer(Inner(3), "b")
    with pytest.raises(ValueError, match=r"^<inner.size> must be >= 1, got 0$") as error:
        compose(Outer(), {"inner.size": 0}, label=lambda path: f"<{path}>")
    assert not isinstance(error.value, FieldError)  # named once, at the part that refused it


def test_a_setting_without_a_flag_or_key_must_say_why():
    with pytest.raises(ValueError, match="file_only must say why"):
        setting(1, key="k", help="h")
    with pytest.raises(ValueError, match="flag_only must say why"):
        setting(1, flag="--f", help="h")


def test_the_engine_alone_is_walked_like_the_cluster():
    assert [leaf.path for leaf in settings(EngineConfig)] == [
        leaf.path.removeprefix("engine.") for leaf in SETTINGS if leaf.path.startswith("engine.")]


def _up_parser():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    return commands.choices["up"]
