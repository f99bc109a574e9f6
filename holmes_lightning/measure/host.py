"""This machine as the lab and the bench see it: its cores, one single-thread rank's matmul speed, and a process's
resident memory (to check the planner's memory estimate)."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import torch

MATMUL_SIZE = 384


def cpu_gflops(seconds: float = 0.25) -> float:
    """Single-thread fp32 matmul throughput of this CPU, as one lab rank sees it.

    The fastest of many short matmuls: other work on a shared machine slows some of them, not the CPU itself.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(MATMUL_SIZE, MATMUL_SIZE), torch.randn(MATMUL_SIZE, MATMUL_SIZE)
        fastest, deadline = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            a @ b
            fastest = min(fastest, time.perf_counter() - start)
        return 2 * MATMUL_SIZE**3 / fastest / 1e9
    finally:
        torch.set_num_threads(threads)


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def rank_share(world_size: int) -> float:
    """The fraction of a core each of `world_size` ranks on this machine gets when they all compute at once."""
    return min(1.0, available_cores() / world_size)


def cpu_rank_gflops(world_size: int) -> float:
    """What one of `world_size` single-thread ranks on this machine computes: its core share of `cpu_gflops`."""
    return cpu_gflops() * rank_share(world_size)


def resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm)."""
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int:
    """The most resident memory this process has held so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
