"""The background KV audit's settings travel `pdserve up` flags / YAML -> ClusterSpec -> WorkerSpec
-> WorkerConfig, and a bad value is a usage error naming the key and the flag."""

from __future__ import annotations

import textwrap

import pytest

from decode_worker.actor import DecodeWorker
from deploy.cli import build_parser, main
from deploy.config import ClusterSpec, load_config
from deploy.launcher import LocalCluster
from deploy.redis_server import RedisServer
from deploy.up import spec_from_args
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.worker.scrubber import AuditSchedule, AuditScrubber


def test_the_file_and_the_flags_set_the_audit_fields(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent("""
        audit: {interval_s: 30, max_fraction: 0.1}
    """))
    assert load_config(path) == ClusterSpec(audit=AuditSchedule(interval_s=30, max_fraction=0.1))
    args = build_parser().parse_args(["up", "--config", str(path), "--audit-max-fraction", "0.02"])
    assert spec_from_args(args) == ClusterSpec(audit=AuditSchedule(interval_s=30, max_fraction=0.02))
    assert ClusterSpec().audit.interval_s is None  # off by default


@pytest.mark.parametrize("text, message", [
    ("audit: {interval_s: 0}", r"audit.interval_s \(--audit-interval-s\) must be > 0 seconds"),
    ("audit: {interval_s: 5, max_fraction: 2}",
     r"audit.max_fraction \(--audit-max-fraction\) must be in \(0, 1\]"),
    ("audit: {max_fraction: fast}", "'audit.max_fraction' must be a number"),
])
def test_a_bad_audit_setting_names_the_key(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_a_bad_audit_flag_is_a_usage_error(capsys):
    assert main(["up", "--audit-interval-s", "-1"]) == 2
    assert "--audit-interval-s" in capsys.readouterr().err


def test_a_worker_started_by_the_launcher_runs_the_scrubber_it_was_given(tiny_model_dir):
    cluster = LocalCluster(ClusterSpec(engine=EngineConfig(model_path=str(tiny_model_dir),
                                                           cache=CacheConfig(num_blocks=16)),
                                       audit=AuditSchedule(interval_s=7.5, max_fraction=0.1),
                                       namespace="t-audit"))
    with RedisServer() as server:
        cluster.redis_url = server.url
        spec = cluster._worker_spec("decode", "decode-0", threads=1)
        assert spec.audit == AuditSchedule(interval_s=7.5, max_fraction=0.1)
        actor = DecodeWorker(spec)
        try:
            scrubber = actor.server.scrubber
            assert isinstance(scrubber, AuditScrubber) and scrubber._thread.is_alive()
            assert (scrubber.interval_s, scrubber.max_fraction) == (7.5, 0.1)
        finally:
            actor.stop()
        cluster.spec = ClusterSpec(engine=EngineConfig(model_path=str(tiny_model_dir)))
        assert cluster._worker_spec("decode", "decode-0", threads=1).audit.interval_s is None
