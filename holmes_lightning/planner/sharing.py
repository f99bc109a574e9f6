"""Compute on CPU cores that every rank of the job shares: how long each action takes when it runs beside others.

On a GPU cluster every rank computes on its own device. Ranks of one CPU machine (the emulated lab, CPU training on
one host) share its cores: while k ranks compute at once on c cores, each runs at min(1, c / k) of its speed alone,
so a rank that computes while the others wait on a link or in the pipeline's bubble finishes sooner than one that
computes beside all of them (the stages of a step do not all compute at the same time).

`settle` finds the durations that agree with the timeline they produce: each action's seconds at its speed alone,
stretched by the number of ranks computing meanwhile (a stage's `ranks_per_stage` ranks compute together), timed by
`Replay.ends`, over and over until no duration moves. Every duration is at least the action's seconds alone, so the
planner's lower bounds (timed at that speed) stay lower bounds; with a core for every rank it is `Replay.ends`.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Timing = tuple[list[float], list[float]]  # every action's end, every stage's clock

ROUNDS = 40  # fixed-point rounds at most; a step's timeline settles in a few
TOLERANCE = 1e-6  # relative change of the step below which it has settled


@dataclass(frozen=True)
class CoreSharing:
    """`cores` of one machine shared by every rank; `ranks_per_stage` ranks compute each stage's actions together."""

    cores: float
    ranks_per_stage: int

    def all_busy(self, pp: int) -> float:
        """How much slower than alone each rank computes while every rank of `pp` stages does."""
        return max(1.0, self.ranks_per_stage * pp / self.cores)

    def contended(self, pp: int) -> bool:
        return self.all_busy(pp) > 1.0


def settle(
    alone: Sequence[float], pp: int, sharing: CoreSharing, timed: Callable[[Sequence[float]], Timing]
) -> tuple[list[float], list[float], list[float]]:
    """Every action's seconds under `sharing` and the timeline they give: (durations, action ends, stage clocks).

    `alone`: each action's seconds at its rank's speed alone; `timed`: the action ends and stage clocks of per-action
    durations (`Replay.ends`).
    """
    all_busy = sharing.all_busy(pp)
    durations = [seconds * all_busy for seconds in alone]  # start from every rank computing at once
    ends, clock = timed(durations)
    step = max(clock)
    for _ in range(ROUNDS):
        starts = [end - seconds for end, seconds in zip(ends, durations, strict=True)]
        moved = _stretched(starts, alone, ends, sharing)
        durations = [(old + new) / 2 for old, new in zip(durations, moved, strict=True)]  # damped: no ping-pong
        ends, clock = timed(durations)
        previous, step = step, max(clock)
        if abs(step - previous) <= TOLERANCE * step:
            break
    return durations, ends, clock


def _stretched(
    starts: Sequence[float], alone: Sequence[float], ends: Sequence[float], sharing: CoreSharing
) -> list[float]:
    """Each action's seconds from its start at the speed the ranks computing meanwhile leave it (they are counted
    as in the timeline `starts`/`ends`; the action itself always counts)."""
    changes: dict[float, int] = {}
    for start, end in zip(starts, ends, strict=True):
        if end > start:
            changes[start] = changes.get(start, 0) + sharing.ranks_per_stage
            changes[end] = changes.get(end, 0) - sharing.ranks_per_stage
    times = sorted(changes)
    busy, running = [], 0
    for time in times:
        running += changes[time]
        busy.append(running)  # ranks computing from times[j] to times[j + 1]
    durations = []
    for start, seconds, end in zip(starts, alone, ends, strict=True):
        j = bisect_right(times, start) - 1
        now, left = start, seconds
        while True:
            ranks = busy[j] if j >= 0 else 0
            if now >= end:  # past its end in that timeline, where the profile no longer counts it
                ranks += sharing.ranks_per_stage
            speed = min(1.0, sharing.cores / max(ranks, sharing.ranks_per_stage))
            boundary = times[j + 1] if j + 1 < len(times) else math.inf
            if now < end:
                boundary = min(boundary, end)
            finish = now + left / speed
            if finish <= boundary:
                durations.append(finish - start)
                break
            left -= (boundary - now) * speed
            now = boundary
            if j + 1 < len(times) and now >= times[j + 1]:
                j += 1
    return durations
