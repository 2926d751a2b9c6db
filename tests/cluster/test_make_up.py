"""`pdserve up` as a user runs it: sample answer, served from another shell, Ctrl-C cleans up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from deploy.redis_server import free_port


def read_until(proc: subprocess.Popen, marker: str, timeout_s: float) -> str:
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if marker in line:
            return "".join(seen)
    raise AssertionError(f"{marker!r} not seen within {timeout_s} s; output:\n{''.join(seen)}")


def port_is_free(port: int) -> bool:
    return not any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                   for c in psutil.net_connections(kind="tcp"))


def check_loadtest(port: int, out) -> None:
    """`pdserve loadtest` writes the report and plots, and its counts agree with the router's
    own Prometheus counters (scraped by the load test before and after, found via Admin)."""
    command = [sys.executable, "-m", "deploy.cli", "loadtest", "--router", f"127.0.0.1:{port}",
               "--workload", "shared-prefix", "-p", "system_prompt_tokens=100", "-p", "question_tokens=8",
               "-p", "output_tokens=6", "--requests", "8", "--concurrency", "2", "--out", str(out),
               "--no-progress"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads((out / "report.json").read_text())
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert all(report[key][q] > 0 for q in ("p50", "p90", "p99")), (key, report[key])
    assert report["throughput_tokens_per_s"] > 0 and report["errors"] == {}
    assert report["counts"]["completed"] == 8 and report["output_tokens_total"] == 8 * 6
    assert 0 < report["prefix_hit_rate"] < 1 and report["goodput"]["requests"] <= 8
    server = report["server_metrics"]
    assert server["error"] is None
    assert server["pdserve_router_requests_total"] == {"OK": 8}
    assert server["pdserve_router_generated_tokens_total"] == report["output_tokens_total"]
    assert server["pdserve_router_prompt_tokens_total"] == report["prompt_tokens_total"]
    assert server["pdserve_router_cached_tokens_total"] == report["cached_tokens_total"] > 0
    plots = sorted(p.name for p in out.glob("*.png"))
    assert plots and all((out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots), plots


def check_loadtest_over_http(http_port: int, out) -> None:
    """`pdserve loadtest --api openai`: the same shared-prefix workload over the OpenAI-compatible
    HTTP API, streamed; its counts agree with the router's counters, scraped at the URL's /metrics."""
    command = [sys.executable, "-m", "deploy.cli", "loadtest", "--api", "openai",
               "--url", f"http://127.0.0.1:{http_port}", "--workload", "shared-prefix",
               "-p", "system_prompt_tokens=100", "-p", "question_tokens=8", "-p", "output_tokens=6",
               "--requests", "6", "--concurrency", "2", "--seed", "1", "--out", str(out), "--no-progress"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["api"] == "openai" and report["errors"] == {} and report["counts"]["completed"] == 6
    assert all(report[key]["p50"] > 0 for key in ("ttft_ms", "itl_ms", "e2e_ms")), report
    assert report["output_tokens_total"] == 6 * 6 and report["itl_ms"]["count"] == 6 * 5
    assert 0 < report["prefix_hit_rate"] < 1
    server = report["server_metrics"]
    assert server["url"] == f"http://127.0.0.1:{http_port}/metrics" and server["error"] is None
    assert server["pdserve_router_requests_total"] == {"OK": 6}
    assert server["pdserve_router_generated_tokens_total"] == report["output_tokens_total"]
    assert server["pdserve_router_prompt_tokens_total"] == report["prompt_tokens_total"]
    assert server["pdserve_router_cached_tokens_total"] == report["cached_tokens_total"]


def check_status(port: int) -> None:
    command = [sys.executable, "-m", "deploy.cli", "status", "--router", f"127.0.0.1:{port}"]
    status = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()[2:]
    rows = {line.split()[0]: line.split() for line in lines if not line.startswith("kernels on ")}
    assert set(rows) == {"prefill-0", "decode-0"}
    assert any(line.startswith("kernels on prefill-0, decode-0: linear ") for line in lines), status.stdout
    assert all(row[3] == "serving" for row in rows.values()), status.stdout


@pytest.mark.slow
def test_up_answers_serves_and_ctrl_c_leaves_nothing(tmp_path):
    port, http_port = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "up", "--port", str(port),
                             "--http-port", str(http_port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output = read_until(proc, "serving on", timeout_s=300)
        assert "Paris" in output
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert any("redis-server" in " ".join(p.cmdline()) for p in descendants)
        command = [sys.executable, "-m", "deploy.cli", "generate", "--router", f"127.0.0.1:{port}",
                   "--temperature", "0", "--max-tokens", "8", "Say hello."]
        served = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert served.returncode == 0 and served.stdout.strip(), served.stderr
        check_loadtest(port, tmp_path / "loadtest")
        check_loadtest_over_http(http_port, tmp_path / "loadtest-http")
        check_status(port)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(1.0)
    alive = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [" ".join(p.cmdline())[:120] for p in alive]
    assert port_is_free(port) and port_is_free(http_port)
