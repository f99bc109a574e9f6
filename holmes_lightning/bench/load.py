"""How busy the machine was with other work while a run's ranks ran: CPU time no process of the bench used.

The lab's ranks share the machine's cores, so anything else that computes meanwhile slows them, and the measured
steps no longer say what the plan costs. Every run records the machine's busy CPU seconds (`/proc/stat`) and the
bench's own (this process and its finished children, the ranks); the difference, per second of the run and core, is
the share of the machine that other work took (the kernel's shaping of the lab's links counts there too, a little).
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

from holmes_lightning.measure import available_cores

IDLE_FIELDS = (3, 4)  # idle and iowait among /proc/stat's cpu fields


@dataclass(frozen=True)
class CpuClock:
    """CPU seconds the machine spent busy and the bench spent, at one wall-clock time."""

    wall_s: float
    busy_s: float
    ours_s: float

    @classmethod
    def now(cls) -> CpuClock:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy_ticks = sum(value for i, value in enumerate(fields) if i not in IDLE_FIELDS)
        ours = sum(
            usage.ru_utime + usage.ru_stime
            for usage in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
        )
        return cls(time.monotonic(), busy_ticks / os.sysconf("SC_CLK_TCK"), ours)

    def foreign_share(self, later: CpuClock) -> float:
        """The machine's cores other work kept busy between this reading and `later`, as a fraction of them all."""
        wall = later.wall_s - self.wall_s
        foreign = (later.busy_s - self.busy_s) - (later.ours_s - self.ours_s)
        return max(foreign, 0.0) / (wall * available_cores()) if wall > 0 else 0.0
