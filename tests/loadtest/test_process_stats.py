"""The soak's process measurements, on this test's own process: descriptors by kind, with
each established TCP connection named by the process at the other end."""

from __future__ import annotations

import os
import socket

from loadtest.process_stats import Peers, process_usage


def test_descriptors_are_counted_by_kind_and_connections_by_peer(tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server_side, _ = listener.accept()
    read_end, write_end = os.pipe()
    log = open(tmp_path / "x.log", "w")  # noqa: SIM115 (closed below)
    try:
        rss, fds, kinds = process_usage(os.getpid(), Peers({os.getpid(): "this test"}))
        # NOTE: counting its own process, num_fds also sees the descriptor of its own listing
        assert rss > 0 and fds - sum(kinds.values()) in (0, 1)
        assert kinds["tcp ESTABLISHED this test"] >= 2  # both ends of the connection are here
        assert kinds["tcp LISTEN"] >= 1
        assert kinds["pipe"] >= 2
        assert kinds[str(tmp_path / "x.log")] == 1
    finally:
        for s in (client, server_side, listener):
            s.close()
        os.close(read_end)
        os.close(write_end)
        log.close()
    _, fds_after, kinds_after = process_usage(os.getpid())
    assert fds_after == fds - 6 and str(tmp_path / "x.log") not in kinds_after
