"""`pdserve loadtest` / `python -m loadtest`: flags to a run, files out, compare mode."""

from __future__ import annotations

import json
import subprocess
import sys

from deploy.cli import build_parser
from deploy.cli import main as pdserve_main
from loadtest import cli
from tests.loadtest.fake_openai import FakeOpenAI, serving_openai
from tests.loadtest.fake_router import FakeRouter, serving

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_a_loadtest_over_two_routers_spreads_its_requests_over_both(tmp_path):
    first, second = FakeRouter(), FakeRouter()
    with serving(first) as a, serving(second) as b:
        code = pdserve_main(["loadtest", "--router", f"{a.target},{b.target}", "--workload", "synthetic",
                             "--requests", "8", "--concurrency", "2", "--out", str(tmp_path),
                             "--no-progress"])
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["counts"]["completed"] == 8
    served = [r.registry.get_sample_value("pdserve_router_requests_total", {"code": "OK"})
              for r in (first, second)]
    assert sum(served) == 8 and min(served) >= 1, served


def test_the_issue_command_line_writes_report_json_and_plots(tmp_path, capsys):
    fake = FakeRouter()
    with serving(fake) as s:
        code = pdserve_main(["loadtest", "--router", s.target, "--workload", "mixed",
                             "-p", "long_prompt_min=20", "-p", "long_prompt_max=30",
                             "-p", "short_max_tokens_min=3", "-p", "short_max_tokens_max=4",
                             "--requests", "8", "--concurrency", "2",
                             "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert {"ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "throughput_tokens_per_s", "goodput",
            "prefix_hit_rate", "errors"} <= set(report)
    assert report["workload"]["name"] == "mixed" and report["workload"]["params"]["long_prompt_min"] == 20
    assert report["counts"]["completed"] == 8 and set(report["by_kind"]) <= {"long", "short"}
    for png in ("latency_cdf.png", "throughput.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr().out
    assert "TTFT ms" in out and "report.json" in out


def test_api_openai_sends_the_same_workload_over_http(tmp_path, capsys):
    fake = FakeOpenAI()
    with serving_openai(fake) as url:
        code = pdserve_main(["loadtest", "--api", "openai", "--url", url, "--workload", "shared-prefix",
                             "-p", "system_prompt_tokens=20", "-p", "output_tokens=3", "--requests", "4",
                             "--concurrency", "2", "--top-k", "5", "--stop", "END", "--out", str(tmp_path),
                             "--no-progress"])
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["api"] == "openai" and report["router"] == url and report["counts"]["completed"] == 4
    assert report["request_options"]["top_k"] == 5 and report["request_options"]["stop"] == ["END"]
    assert [b["messages"][0]["role"] for b in fake.bodies] == ["system"] * 4
    assert all(b["top_k"] == 5 and b["stop"] == ["END"] for b in fake.bodies)
    assert "TTFT ms" in capsys.readouterr().out


def test_compare_mode_over_http_takes_a_second_url(tmp_path):
    a, b = FakeOpenAI(), FakeOpenAI()
    with serving_openai(a) as url_a, serving_openai(b) as url_b:
        code = cli.main(["--api", "openai", "--url", url_a, "--against", url_b, "--requests", "3",
                         "--rate", "inf", "-p", "input_tokens=4", "-p", "output_tokens=3",
                         "--out", str(tmp_path), "--no-progress"])
    assert code == 0 and len(a.bodies) == len(b.bodies) == 3
    contents = lambda fake: sorted(x["messages"][0]["content"] for x in fake.bodies)
    assert contents(a) == contents(b)
    comparison = json.loads((tmp_path / "compare.json").read_text())
    assert (comparison["a"], comparison["b"]) == (url_a, url_b) and comparison["same_workload"]


def test_compare_mode_runs_the_same_workload_twice_and_prints_ratios(tmp_path, capsys):
    fake = FakeRouter()
    with serving(fake) as s:
        code = cli.main(["--router", s.target, "--against-routing", "round_robin", "--requests", "3",
                         "--rate", "inf", "-p", "input_tokens=4", "-p", "output_tokens=3",
                         "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    assert [r.routing for r in fake.requests] == [""] * 3 + ["round_robin"] * 3
    # the same seed: the same prompts both times
    prompts = [r.chat.messages[0].content for r in fake.requests]
    assert sorted(prompts[:3]) == sorted(prompts[3:])
    comparison = json.loads((tmp_path / "compare.json").read_text())
    assert comparison["b"].endswith("routing=round_robin") and comparison["same_workload"]
    assert (tmp_path / "a" / "report.json").exists() and (tmp_path / "b" / "throughput.png").exists()
    assert "B/A" in capsys.readouterr().out


def test_errors_are_user_errors(capsys):
    assert cli.main(["--router", "127.0.0.1:1"]) == 2
    assert "--rate R" in capsys.readouterr().err
    assert cli.main(["--concurrency", "1"]) == 2
    assert "--router HOST:PORT is required" in capsys.readouterr().err
    assert cli.main(["--router", "127.0.0.1:1", "--concurrency", "1", "-p", "nope=1"]) == 2
    assert "has no parameter 'nope'" in capsys.readouterr().err
    assert cli.main(["--router", "127.0.0.1:9", "--concurrency", "1", "--connect-timeout", "0.3"]) == 2
    assert "cannot reach the router" in capsys.readouterr().err
    assert cli.main(["--api", "openai", "--concurrency", "1"]) == 2
    assert "--api openai needs --url" in capsys.readouterr().err
    assert cli.main(["--api", "openai", "--url", "http://h:1", "--routing", "prefix",
                     "--concurrency", "1"]) == 2
    assert "no per-request routing" in capsys.readouterr().err
    assert cli.main(["--router", "127.0.0.1:1", "--url", "http://h:1", "--concurrency", "1"]) == 2
    assert "--url and --model go with --api openai" in capsys.readouterr().err


def test_every_flag_has_help():
    parser = cli.build_parser()
    assert all(action.help for action in parser._actions)
    loadtest = build_parser()._subparsers._group_actions[0].choices["loadtest"]
    assert {a.dest for a in loadtest._actions} == {a.dest for a in parser._actions}


def test_python_dash_m_loadtest_is_the_plain_script():
    done = subprocess.run([sys.executable, "-m", "loadtest", "--list-workloads"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0
    for name in ("synthetic", "shared-prefix", "multi-turn", "long-doc", "mixed"):
        assert f"{name}:" in done.stdout
