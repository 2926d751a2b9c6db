"""`pdserve sim calibrate --in-cluster`, small: one topology, one load, through the real cluster.

The fit is only as good as the trace under it, so the test checks the trace against what the load
must have cost: each of the 6 requests samples its first token in its prefill step, then decodes 7
tokens one step each, so the traced steps hold exactly 42 decode rows and 240 prefill tokens (the
warm-up's steps, which pay for torch's lazy set-up, are not among them).
"""

from __future__ import annotations

from pdserve.engine.config import cpu_threads_per_worker
from sim.measure.calibrate_cluster import calibrate_in_cluster
from sim.measure.real import Load

# token ids, not chat text: exact prompt lengths (random ids: no prefix of one is cached by another)
LOAD = Load("synthetic", {"input_tokens": 40, "output_tokens": 8, "token_ids": True}, rate=2.0, requests=6,
            seed=7)


def test_the_in_cluster_calibration_fits_every_step_the_load_ran_and_no_other(ray_session):
    model = calibrate_in_cluster(cpu_threads_per_worker(2), topologies=("2 colocated",), loads=(LOAD,))
    source, step = model.source, model.step
    rows = source["samples"]["rows"]
    assert source["calibrated_in"] == "cluster" and source["topologies"] == {"2 colocated": len(rows)}
    assert sum(decode_seqs for _, _, decode_seqs, _ in rows) == 6 * 7
    assert sum(prefill_tokens for prefill_tokens, _, _, _ in rows) == 6 * 40
    assert step.shared_machine_slowdown == 0  # the workers' contention is inside the traced times
    assert len(step.spread) == len(rows) and step.token_curve[0][0] == 1
    assert source["fit_relative_error_median"] < 0.25
    assert model.hardware.num_blocks > 0 and model.transfer.bandwidth_bytes_per_s > 0
    # every request's TTFT less the workers' part of it: the hops through the router, milliseconds here
    assert source["request_overhead_s"]["requests"] == 6 and 0 < model.request.overhead_s < 0.1
