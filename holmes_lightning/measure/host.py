"""This machine as the lab and the bench see it: its cores, one single-thread rank's matmul speed, a process's
resident memory (to check the planner's memory estimate), and the memory a rank may plan to allocate."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import torch

MATMUL_SIZE = 384
GPU_RESERVE_GB = 1.5  # the CUDA context (~0.5 GB) and NCCL's buffers (a few communicators of ~0.1-0.2 GB each)
GPU_RESERVE_SHARE = 0.05  # what the caching allocator loses to fragmentation
CPU_BASELINE_GB = 0.5  # a rank process's own memory: interpreter, torch, Lightning (0.43 GB of RSS measured here)
MEMINFO = Path("/proc/meminfo")
STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


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


def file_resident_bytes() -> int:
    """The part of `resident_bytes` mapped from files: the code and data of loaded libraries, which a process pages
    in as it first runs them (statm's shared pages: RssFile + RssShmem)."""
    shared_pages = int(Path("/proc/self/statm").read_text().split()[2])
    return shared_pages * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int:
    """The most resident memory this process has held so far, or since `restart_peak_resident` (Linux: VmHWM in
    /proc/self/status; getrusage's ru_maxrss would also count the memory of the process that started this one, which
    it inherits across exec)."""
    for line in STATUS.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def restart_peak_resident() -> bool:
    """Make `peak_resident_bytes` count from now (Linux 4.0+: /proc/self/clear_refs); False where it cannot."""
    try:
        CLEAR_REFS.write_text("5")  # 5: reset the peak resident set size
    except OSError:
        return False
    return True


def training_memory_gb(device: torch.device, ranks_on_host: int) -> float | None:
    """What one rank may plan to allocate for training (the planner's memory estimate leaves out the process's own
    baseline): a GPU's memory less `GPU_RESERVE_SHARE` and `GPU_RESERVE_GB`; on CPU the host's available memory shared
    by its ranks, less each one's baseline. None where neither is known."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 1e9
        return total * (1 - GPU_RESERVE_SHARE) - GPU_RESERVE_GB
    available = available_memory_gb(MEMINFO.read_text()) if MEMINFO.is_file() else None
    return None if available is None else max(available / ranks_on_host - CPU_BASELINE_GB, 0.1)


def available_memory_gb(meminfo: str) -> float | None:
    """`MemAvailable` of /proc/meminfo's text, in GB."""
    for line in meminfo.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024 / 1e9
    return None
