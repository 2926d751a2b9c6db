"""Load tests of a running pdserve router: workloads, arrivals, a gRPC load generator, the report.

    from loadtest.runner import LoadTestConfig, run_loadtest
    report = run_loadtest(LoadTestConfig(router="127.0.0.1:50051"), out_dir="results")

See loadtest/README.md for the files, the command line and the report's schema.
"""
