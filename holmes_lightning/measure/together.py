"""What the job's ranks measure together, every one of them computing: a message between two ranks (`handoff`: its
latency and CPU), a pipelined step's closing collectives (`step_collectives_s`), and what moving a byte between ranks
costs the cores they share (`transfer_cpu_s_per_byte`). `local_handoff_latency_s` starts ranks on this machine for
the hand-off; `cached_measurement` keeps such machine measurements next to the calibration's (`cache_dir()`).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from holmes_lightning.launch.processes import free_port
from holmes_lightning.measure.calibration import CACHE_VERSION, cache_dir, device_name, synchronize, write_whole
from holmes_lightning.topology import Topology

TRANSFER_BYTES = 128 * 2**20  # what `transfer_cpu_s_per_byte` sends, in messages of TRANSFER_MESSAGE_BYTES
TRANSFER_MESSAGE_BYTES = 4 * 2**20
TRANSFER_ROUNDS = 3
HANDOFF_ROUNDS = 20
HANDOFF_BURST_S = 2e-3  # CPU seconds a rank computes between hand-offs: a micro-batch's work on a lab rank


class Handoff(NamedTuple):
    """A message between two ranks while every rank computes: its seconds, and the CPU seconds both ends spend on it
    (every thread of their processes: the sockets, the wake-ups)."""

    latency_s: float
    cpu_s: float


def cross_node_partners(topology: Topology) -> list[int]:
    """Per rank, a partner on another node (nodes paired in order, ranks by position; -1: none), so a hand-off
    crosses the network as a pipeline's messages between stages do; one node: neighbours on it (0-1, 2-3, ...)."""
    world = topology.world_size
    if len(topology.nodes) == 1:
        return [rank ^ 1 if rank ^ 1 < world else -1 for rank in range(world)]
    partners = [-1] * world
    for first, second in zip(topology.nodes[::2], topology.nodes[1::2], strict=False):
        for a, b in zip(first.ranks, second.ranks, strict=False):
            partners[a], partners[b] = b, a
    return partners


def handoff(
    device: torch.device,
    *,
    partners: Sequence[int] | None = None,
    burst_s: float = HANDOFF_BURST_S,
    rounds: int = HANDOFF_ROUNDS,
) -> Handoff:
    """A pipeline's hand-off between two ranks, timed while every rank computes.

    Every rank of the default group calls it. Ranks pair up (`partners[rank]`, -1: none; default 0-1, 2-3, ...); all
    compute `rounds` bursts of `burst_s` (this thread's CPU time, whatever else runs) alternating with as many after
    which they swap a message with their partner, the device synchronised after each (NCCL returns when the work is
    queued), one exchange before all to build the communicators; the difference per message is its latency
    (on a CPU whose cores the ranks share, mostly the time a woken rank waits for one) and its CPU. Every rank gets
    the means over the pairs.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    partner = (partners[rank] if partners is not None else rank ^ 1) if world > 1 else -1
    if world == 1:
        return Handoff(0.0, 0.0)
    message = torch.zeros(1, device=device)

    def exchange() -> None:
        if not 0 <= partner < world:
            return
        first, then = (dist.send, dist.recv) if rank < partner else (dist.recv, dist.send)
        first(message, partner)
        then(message, partner)

    wall_s, cpu_s = _extra_per_round(exchange, device, burst_s=burst_s, rounds=rounds)
    paired = float(0 <= partner < world)
    mine = torch.tensor([wall_s / 2 * paired, cpu_s * paired, paired], device=device)  # 2 messages per round
    dist.all_reduce(mine)
    latency_s, cpu_per_rank, pairs = (float(value) for value in mine)
    return Handoff(latency_s / pairs, cpu_per_rank / pairs)  # a message: one end's CPU per round is both ends' share


def step_collectives_s(
    device: torch.device, collectives: int, *, burst_s: float = HANDOFF_BURST_S, rounds: int = HANDOFF_ROUNDS
) -> float:
    """Seconds a step spends in `collectives` small collectives over every rank, one after another, each after a
    little host work (the loss's all-reduce, Lightning's stop-signal broadcast, a clipping norm's all-reduce).

    Every rank of the default group calls it, timed as `handoff` times a message (the collectives after each burst,
    a scalar all-reduce each); the slowest rank's time (on shared cores it includes waking the ranks that wait).
    """
    if dist.get_world_size() == 1 or collectives == 0:
        return 0.0
    scalar = torch.zeros(1, device=device)

    def reduce() -> None:
        for _ in range(collectives):
            dist.all_reduce(scalar)

    mine = torch.tensor([_extra_per_round(reduce, device, burst_s=burst_s, rounds=rounds)[0]], device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine[0])


def _extra_per_round(
    action: Callable[[], None], device: torch.device, *, burst_s: float, rounds: int
) -> tuple[float, float]:
    """What `action` adds to a burst of computing `burst_s` (this thread's CPU time) on every rank: wall seconds, and
    CPU seconds of this process (all its threads). `rounds` bursts alone alternate with as many followed by the
    action; the medians' difference (a sum's difference let one preempted burst hide the action). The action runs
    once before (warming up its communicators), and the device is synchronised after each (its collectives done, not
    only queued)."""
    work = torch.full((64, 64), 0.01, device=device)
    action()
    synchronize(device)
    walls: dict[bool, list[float]] = {False: [], True: []}
    cpus: dict[bool, list[float]] = {False: [], True: []}
    dist.barrier()
    for _ in range(rounds):
        for act in (False, True):
            wall, cpu = time.perf_counter(), time.process_time()
            until = time.thread_time() + burst_s
            while time.thread_time() < until:
                torch.mm(work, work)
            synchronize(device)
            if act:
                action()
                synchronize(device)
            walls[act].append(time.perf_counter() - wall)
            cpus[act].append(time.process_time() - cpu)
    extra_wall = statistics.median(walls[True]) - statistics.median(walls[False])
    extra_cpu = statistics.median(cpus[True]) - statistics.median(cpus[False])
    return max(extra_wall, 0.0), max(extra_cpu, 0.0)


def transfer_cpu_s_per_byte(nbytes: int = TRANSFER_BYTES, rounds: int = TRANSFER_ROUNDS) -> float:
    """CPU seconds this machine spends per byte one rank sends another: sender, receiver and the kernel between them.

    Every rank of the default group (all on this machine) calls it. Each round rank 0 sends `nbytes` to rank 1 while
    the others wait, then idles as long: the machine's busy time over the transfer (/proc/stat) less that over the
    idle stretch, per byte. Every rank gets rank 0's median over the rounds (0 without /proc/stat or a second rank).
    """
    result = torch.zeros(1, dtype=torch.float64)
    if dist.get_world_size() > 1 and Path("/proc/stat").is_file():
        result[0] = statistics.median(_transfer_round(nbytes) for _ in range(rounds))
    dist.broadcast(result, 0)
    return float(result[0])


def _transfer_round(nbytes: int) -> float:
    """One round of `transfer_cpu_s_per_byte`: its cost per byte on rank 0, 0 on the others."""
    rank = dist.get_rank()
    message = torch.zeros(TRANSFER_MESSAGE_BYTES, dtype=torch.uint8)
    messages = max(1, nbytes // message.numel())
    dist.barrier()
    busy, start = _busy_s(), time.perf_counter()
    for _ in range(messages):
        if rank == 0:
            dist.send(message, 1)
        elif rank == 1:
            dist.recv(message, 0)
    dist.barrier()
    moving_s, elapsed = _busy_s() - busy, time.perf_counter() - start
    if rank != 0:
        return 0.0
    busy = _busy_s()
    time.sleep(elapsed)
    return max(moving_s - (_busy_s() - busy), 0.0) / (messages * message.numel())


def _busy_s() -> float:
    """CPU seconds every core of this machine has spent busy since boot (not idle, not waiting on I/O)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def cached_measurement(kind: str, key: list, measure: Callable[[], float]) -> float:
    """`measure()`'s result for this `kind` and `key` (with the cache version and this machine's CPU), from the cache
    when it has one, else measured now and cached."""
    shape = json.dumps([CACHE_VERSION, device_name(torch.device("cpu")), kind, *key])
    path = cache_dir() / f"{kind}-{hashlib.sha256(shape.encode()).hexdigest()[:24]}.json"
    if path.is_file():
        return json.loads(path.read_text())["value"]
    value = measure()
    write_whole(path, {"value": value})
    return value


def local_handoff_latency_s(world_size: int, *, burst_s: float = HANDOFF_BURST_S) -> float:
    """`handoff`'s latency for `world_size` single-thread ranks on this machine (loopback), started here for it, or
    the cached result for this device and rank count."""
    if world_size == 1:
        return 0.0
    return cached_measurement(
        "handoff", [world_size, burst_s, HANDOFF_ROUNDS], lambda: _local_handoff(world_size, burst_s)
    )


def _local_handoff(world_size: int, burst_s: float) -> float:
    port = free_port()
    code = (
        "import sys, torch, torch.distributed as dist; from holmes_lightning.measure.together import handoff; "
        "rank, world, port, burst = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]); "
        "torch.set_num_threads(1); "
        "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world); "
        "print(handoff(torch.device('cpu'), burst_s=burst).latency_s); dist.destroy_process_group()"
    )
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank), str(world_size), str(port), str(burst_s)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in range(world_size)
    ]
    outputs = [process.communicate()[0] for process in ranks]
    if any(process.returncode for process in ranks):
        raise RuntimeError(f"measuring the hand-off latency of {world_size} local ranks failed; their output is above")
    return float(outputs[0].split()[-1])
