"""Load shared between router replicas (router/shared_load.py): the arithmetic, then the directory."""

from __future__ import annotations

from router.shared_load import LoadReport, SeenReport, estimated_load, note_report
from router.workers import WorkerDirectory
from tests.router.test_placement_salts import record


def report(seq: int, running: int = 0, waiting: int = 0, epoch: int = 1, used: int = 0) -> LoadReport:
    return LoadReport(epoch=epoch, seq=seq, running=running, waiting=waiting, used_blocks=used, free_blocks=0)


def test_a_load_hash_without_a_seq_is_no_report():
    assert LoadReport.of({"active": 3}) is None
    assert LoadReport.of({"seq": 4, "epoch": 2, "active": 3, "waiting": 1, "used_blocks": 7}) == LoadReport(
        epoch=2, seq=4, running=3, waiting=1, used_blocks=7, free_blocks=0)


def test_without_a_report_the_estimate_is_this_routers_own_count():
    assert estimated_load(None, 5) == 5


def test_the_estimate_adds_what_this_router_placed_since_it_read_the_report():
    seen = note_report(None, report(1, running=6, waiting=2), in_flight=3)  # 5 of the 8 are other routers'
    assert estimated_load(seen, 3) == 8
    assert estimated_load(seen, 5) == 10  # two more of ours since
    assert estimated_load(seen, 1) == 6  # two of ours finished since


def test_the_estimate_never_falls_below_this_routers_own_requests():
    seen = note_report(None, report(1, running=0), in_flight=2)  # reported before ours arrived
    assert estimated_load(seen, 2) == 2
    assert estimated_load(seen, 4) == 4


def test_rereading_the_same_report_keeps_its_baseline_and_a_new_one_moves_it():
    first = note_report(None, report(1, running=4), in_flight=1)
    assert note_report(first, report(1, running=4), in_flight=3) is first
    moved = note_report(first, report(2, running=6), in_flight=3)
    assert moved == SeenReport(report(2, running=6), 3)
    restarted = note_report(moved, report(2, running=0, epoch=2), in_flight=3)  # same seq, new epoch
    assert restarted == SeenReport(report(2, running=0, epoch=2), 3)
    assert note_report(moved, None, in_flight=3) is None  # the report expired with the lease


def test_two_directories_over_the_same_reports_score_other_routers_requests():
    """This router has 2 requests on d0 and none on d1; d1's report says it runs 5 (another router's).
    d1 scores busier, where this router's own counts alone would call it idle."""
    workers = [record("d0", "decode", "f", "float32"), record("d1", "decode", "f", "float32")]
    loads: dict[str, dict[str, int]] = {"d0": {}, "d1": {}}
    directory = WorkerDirectory(lambda: workers, load_source=lambda w: loads[w])
    directory.refresh()
    loads.update(d0={"epoch": 1, "seq": 9, "active": 2}, d1={"epoch": 1, "seq": 9, "active": 5})
    d0 = next(c for c in directory.candidates("decode") if c.worker_id == "d0")
    with directory.track(d0, d0):
        directory.refresh()
        by_id = {c.worker_id: c.active_requests for c in directory.candidates("decode")}
        assert by_id == {"d0": 2, "d1": 5}
        with directory.track(d0):
            loads = {c.worker_id: c.active_requests for c in directory.candidates("decode")}
            assert loads == {"d0": 3, "d1": 5}
        view = directory.load_view("d1")
        assert (view.reported, view.estimate, view.seq) == (5, 5, 9)
    directory.stop()
