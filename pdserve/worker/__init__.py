"""What every worker shares, whatever its role (prefill_worker/, decode_worker/ hold the rest).

    server.py       WorkerServer: the engine, its loop, the gRPC server; a Role adds its services
    service.py      the Worker service (Abort, Status, Audit); ServingState, TokenTotals, WorkerParts
    engine_loop.py  the thread that steps the engine and fans outputs out to request streams
    actor.py        the Ray actor body: epoch, registry, presence, drain; each role's actor subclasses it
    presence.py     registration and heartbeat in Redis
    scrubber.py     the optional background KV audit
    metrics.py      Prometheus metrics, read from Status
    convert.py      protobuf <-> engine types
"""
