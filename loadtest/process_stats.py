"""What the soak measures of a process: resident memory, open descriptors by kind (TCP
connections named by the process at the other end), and Python allocation growth; plus
release_free_heap, which the soak calls in its own process before an idle sample."""

from __future__ import annotations

import ctypes
import gc
import os
import socket
import sys
import tracemalloc
from collections import Counter


def process_usage(pid: int, peers: Peers | None = None) -> tuple[int, int, dict[str, int]]:
    """Resident bytes, open descriptors, and those descriptors by kind."""
    import psutil

    proc = psutil.Process(pid)
    return proc.memory_info().rss, proc.num_fds(), fd_kinds(proc, peers)


class Peers:
    """Who is at the other end of a loopback TCP connection: every TCP socket on this machine by
    its local address, then the owning process by the names given (router, worker ids, redis),
    else by its process name (raylet, gcs_server, ...)."""

    def __init__(self, names: dict[int, str]) -> None:
        import psutil

        self.names = dict(names)
        self.owner = {(c.laddr.ip, c.laddr.port): c.pid for c in psutil.net_connections(kind="tcp")
                      if c.laddr and c.pid}

    def of(self, conn) -> str:
        import psutil

        pid = self.owner.get((conn.raddr.ip, conn.raddr.port)) if conn.raddr else None
        if pid is None:
            return "?"
        if pid not in self.names:
            try:
                self.names[pid] = psutil.Process(pid).name()
            except psutil.Error:
                self.names[pid] = "?"
        return self.names[pid]


def fd_kinds(proc, peers: Peers | None = None) -> dict[str, int]:
    """Open descriptors by kind, so that a drift in their number says what grew: TCP sockets by
    state and, with peers, by the process at the other end ("tcp ESTABLISHED redis"); unix
    sockets; other sockets (a TCP socket whose connection is gone but whose descriptor is still
    open shows here); pipes; anon inodes ("anon_inode:[eventfd]"); files by path."""
    kinds: Counter[str] = Counter()
    listed = 0
    for conn in proc.net_connections(kind="inet") + proc.net_connections(kind="unix"):
        kind = f"{'unix' if conn.family == socket.AF_UNIX else 'tcp'} {conn.status or ''}".strip()
        if peers is not None and conn.family != socket.AF_UNIX and conn.status == "ESTABLISHED":
            kind += f" {peers.of(conn)}"
        kinds[kind] += 1
        listed += 1
    fd_dir = f"/proc/{proc.pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue  # closed between listdir and readlink
        kind = target.split(":", 1)[0] if target.startswith(("socket:", "pipe:")) else target
        kinds[kind] += 1
    other_sockets = kinds.pop("socket", 0) - listed  # a race can make it < 0
    if other_sockets > 0:
        kinds["socket (other)"] = other_sockets
    return dict(kinds)


def release_free_heap() -> None:
    """Collect cyclic garbage, then hand glibc's free heap pages back to the kernel (malloc_trim),
    so this process's RSS counts live memory, not what the allocator happens to keep. A leak is
    live memory and survives both."""
    gc.collect()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).malloc_trim(0)


def write_memory_growth(before, after, path: str, top: int = 25) -> None:
    """The allocation sites (10-frame tracebacks) whose live Python memory grew the most."""
    lines = [f"traced Python memory now: {tracemalloc.get_traced_memory()[0] / 2**20:.1f} MiB", ""]
    for stat in after.compare_to(before, "traceback")[:top]:
        lines.append(f"{stat.size_diff / 1024:+.1f} KiB in {stat.count_diff:+d} blocks")
        lines.extend(f"    {line}" for line in stat.traceback.format())
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
