"""loadtest.soak's bookkeeping (the soak itself runs for minutes and is not part of `make test`):
its flags, drift judgement, and attribution of failed requests to faults."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from loadtest.soak import Sample, Soak, _drift, parse_args

MIB = 1 << 20


def soak_with(tmp_path, faults=()) -> Soak:
    soak = Soak.__new__(Soak)  # no cluster: only the bookkeeping is under test
    soak.args = SimpleNamespace(out=str(tmp_path), minutes=2)
    soak.faults = list(faults)
    soak.samples = []
    return soak


def worker(pid: int, rss_mib: float, fds: int = 50, used: int = 0, free: int = 512) -> dict:
    return {"pid": pid, "rss": int(rss_mib * MIB), "fds": fds, "used_blocks": used, "free_blocks": free}


def report(started_unix_s: float = 1_795_953_600.0) -> dict:
    return {"counts": {}, "errors": {}, "ttft_ms": {}, "itl_ms": {}, "started_unix_s": started_unix_s}


def summarize(tmp_path, baseline_workers: dict, final_workers: dict, router=(300, 50),
              final_router=(300, 50)):
    (tmp_path / "soak").mkdir(exist_ok=True)
    (tmp_path / "soak" / "requests.jsonl").write_text("")
    baseline = Sample("baseline", router[0] * MIB, router[1], {}, 1, baseline_workers)
    final = Sample("final", final_router[0] * MIB, final_router[1], {}, 1, final_workers)
    return soak_with(tmp_path).summary({"requests_per_s": 1.0}, 0.7, report(), baseline, final)


def test_faults_flag_takes_a_list_and_refuses_unknown_names():
    assert parse_args([]).faults == ["kill-decode", "drain-decode", "redis-down", "kill-prefill"]
    assert parse_args(["--faults", "none"]).faults == ["none"]
    assert parse_args(["--faults", "redis-down, kill-prefill"]).faults == ["redis-down", "kill-prefill"]
    with pytest.raises(SystemExit):
        parse_args(["--faults", "kill-router"])


def test_drift_is_relative_and_none_without_a_baseline():
    assert _drift(100, 101) == 0.01
    assert _drift(100, 97) == -0.03
    assert _drift(0, 5) is None and _drift(5, None) is None


def test_a_restarted_worker_is_listed_but_not_judged(tmp_path):
    summary = summarize(tmp_path, {"decode-0": worker(10, 1500), "decode-2": worker(12, 1500)},
                        {"decode-0": worker(99, 1400), "decode-2": worker(12, 1505)})
    assert summary["drift"]["decode-0"]["restarted"] and summary["drift"]["decode-0"]["rss"] < -0.06
    assert summary["judged"] == ["decode-2", "router"]
    assert summary["drift_target_met"]


@pytest.mark.parametrize("final_workers, final_router", [
    ({"decode-2": worker(12, 1520)}, (300, 50)),  # +1.3% RSS on a worker that lived through
    ({"decode-2": worker(12, 1500, fds=51)}, (300, 50)),  # one more descriptor of 50
    ({"decode-2": worker(12, 1500)}, (297, 50)),  # router shrank by 1%
    ({"decode-2": worker(12, 1500, used=3, free=509)}, (300, 50)),  # blocks still in use
    ({}, (300, 50)),  # a worker did not come back
])
def test_the_target_fails_on_judged_drift_a_leak_or_a_missing_worker(tmp_path, final_workers, final_router):
    summary = summarize(tmp_path, {"decode-2": worker(12, 1500)}, final_workers, final_router=final_router)
    assert not summary["drift_target_met"]


def test_failed_requests_are_attributed_to_the_last_fault_before_they_ended(tmp_path):
    started = 1_795_953_600.0
    faults = [{"minute": 0, "fault": "kill-decode", "at": started + 5},
              {"minute": 1, "fault": "redis-down", "at": started + 65}]
    records = [{"status": "OK", "end_s": 10.0}, {"status": "UNAVAILABLE", "end_s": 7.5},
               {"status": "UNAVAILABLE", "end_s": 20.0}, {"status": "CANCELLED", "end_s": 3.0},
               {"status": "INTERNAL", "end_s": 70.0}]
    (tmp_path / "soak").mkdir()
    (tmp_path / "soak" / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    out = soak_with(tmp_path, faults).errors_by_fault(report())

    assert out == {
        "minute 0 kill-decode": {"count": 2, "statuses": {"UNAVAILABLE": 2}, "latest_s_after_fault": 15.0},
        "before any fault": {"count": 1, "statuses": {"CANCELLED": 1}, "latest_s_after_fault": 0.0},
        "minute 1 redis-down": {"count": 1, "statuses": {"INTERNAL": 1}, "latest_s_after_fault": 5.0},
    }


def test_memory_growth_names_the_allocation_site(tmp_path):
    import tracemalloc

    from loadtest.process_stats import write_memory_growth

    tracemalloc.start(5)
    try:
        before = tracemalloc.take_snapshot()
        kept = [bytearray(4096) for _ in range(64)]  # the growth: 256 KiB from this line
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    write_memory_growth(before, after, str(tmp_path / "tracemalloc.txt"))
    text = (tmp_path / "tracemalloc.txt").read_text()
    first = text.split("\n\n", 1)[1].splitlines()
    assert 256 <= float(first[0].split()[0]) < 300  # KiB: the biggest growth comes first
    assert any("test_soak.py" in line for line in first[1:11]) and len(kept) == 64


def test_the_warm_up_runs_one_minute_per_fault_unless_told():
    assert parse_args([]).warmup_minutes == 4
    assert parse_args(["--faults", "none"]).warmup_minutes == 1
    assert parse_args(["--warmup-minutes", "0"]).warmup_minutes == 0
    with pytest.raises(SystemExit):
        parse_args(["--warmup-minutes", "-1"])


def test_warm_up_minutes_continue_the_fault_cycle_into_the_soak(tmp_path, monkeypatch):
    """Minutes -4..-1 inject each fault once; the soak's minute 0 starts the cycle again. Each
    minute gets one sample, labelled with its phase."""
    soak = soak_with(tmp_path)
    soak.args = SimpleNamespace(out=str(tmp_path), input_tokens=200, output_tokens=32,
                                faults=["kill-decode", "drain-decode", "redis-down", "kill-prefill"])
    soak.router, injected = "127.0.0.1:1", []
    monkeypatch.setattr(soak, "_inject", lambda kind, minute: injected.append((minute, kind)))
    monkeypatch.setattr(soak, "sample", lambda label, idle: soak.samples.append(label))
    monkeypatch.setattr(soak, "run_load", lambda command: command)
    monkeypatch.setattr(soak, "load_report", lambda name, proc: {"name": name, "duration": proc[proc.index(
        "--duration") + 1]})
    monkeypatch.setattr("loadtest.soak._sleep_until", lambda t: None)
    assert soak.faulted_load("warmup", 0.3, range(-4, 0)) == {"name": "warmup", "duration": "240.0"}
    soak.faulted_load("soak", 0.3, range(2))
    assert injected == [(-4, "kill-decode"), (-3, "drain-decode"), (-2, "redis-down"), (-1, "kill-prefill"),
                        (0, "kill-decode"), (1, "drain-decode")]
    assert soak.samples[0] == "warmup minute -4" and soak.samples[-1] == "soak minute 1"
    assert soak.faulted_load("warmup", 0.3, range(0)) is None
