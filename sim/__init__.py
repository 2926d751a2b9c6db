"""The cluster simulator: a discrete-event model of a pdserve cluster, pure Python, seeded.

    workload.py   arrivals: the load tester's workloads (loadtest/workloads.py) or a trace file
    costs.py      the cost model: step time of a worker, KV transfer time (JSON in, JSON out)
    worker.py     one simulated worker: the engine's own BlockPool and Scheduler, timed by costs
    cluster.py    the event loop: router (router/scoring.py), transfers, admission, records
    size.py       sizing: prefill:decode splits x router policies -> goodput under an SLO
    calibrate.py  fits costs.py's coefficients from runs of the engine on this machine
    cli.py        `pdserve sim run|calibrate|size`

Pure: imports pdserve's engine logic, router/scoring.py and loadtest's workloads and stats, never
Ray, gRPC or Redis (tests/test_import_direction.py). docs/simulator.md says what it models.
"""
