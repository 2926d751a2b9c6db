"""What the tests share that is not a fixture (fixtures: tests/conftest.py and a folder's conftest.py).

    workers       worker_server, WorkerStubs, worker_record / worker_info (registry records), and
                  wait_until_clean: the leak check every flow through in-process workers ends with
    cluster       running_cluster / start_router: a router and its workers in this process, over real
                  gRPC (tiny model); generate, generate_request, greedy, metric_value
    ray_cluster   clusters of Ray actors (LocalCluster) and their wait_until_cluster_clean
    rig           a prefill and a decode worker handing KV over a chosen channel (the transfer suite)
    loopback      the in-process KV channel the rig can use
    processes     a worker in another process (to SIGKILL, or for a real process boundary)
    kv_audit      audit_failures: every fault test ends with the KV audit of every worker
    grpc_clients  real gRPC clients that misbehave on purpose (idle streams, held pushes)
    waiting       eventually / wait_for: polling for a condition, never a fixed sleep
"""
