"""Lower bounds on the simulated step, for pruning the partition search (never above what `Replay` predicts).

The simulated step is the longest path through the step's actions: each action after the previous one on its stage
and after the action it waits for (plus the transfer between them). Any path is a lower bound. The paths used here:

- Along one stage: the time the first micro-batch needs to reach it (`head`), every action of the stage in order,
  then its tail (`drain`: its exposed DP sync and optimizer step, or the last gradient's way down to an earlier stage
  and that stage's tail). On the way the path may leave the stage at a forward of its last chunk, climb through
  every later virtual stage and come back down to a backward (`excursion`), and move between its own chunks through
  the virtual stages between them (`up`, `down`). This is the path that makes 1F1B's second round trip or GPipe's
  forward and backward phases count.
- For stages not assigned yet, minimum-over-splits tables (`SuffixBounds`) of the same paths staying on one stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from holmes_lightning.planner.schedules import Action

# (virtual stage, first layer, stop layer) -> (forward s, backward s, send s, tail s), or None if it cannot fit
RangeCost = Callable[[int, int, int], "tuple[float, float, float, float] | None"]


def latest_turns(top_order: Sequence[Action], chunk: int, microbatches: int) -> list[int]:
    """Per micro-batch j': the last micro-batch j whose forward the top stage runs before j''s backward (-1: none).

    A path may climb with micro-batch j and come down with j' only if the top stage runs forward j before backward j'.
    """
    forwards, latest = 0, [-1] * microbatches
    for action in top_order:
        if action.chunk != chunk:
            continue
        if action.backward:
            latest[action.microbatch] = forwards - 1
        else:
            forwards += 1
    return latest


def stage_path_s(
    *,
    order: Sequence[Action],
    forward: Sequence[float],
    backward: Sequence[float],
    head: float,
    drain: float,
    excursion: float | None,
    turns: Sequence[int],
    up: Sequence[float],
    down: Sequence[float],
) -> float:
    """Longest path through one stage's actions (per chunk seconds), with excursions and hops between its chunks."""
    chunks = len(forward)
    top = chunks - 1
    forward_end = [[-math.inf] * len(turns) for _ in range(chunks)]
    backward_end = [[-math.inf] * len(turns) for _ in range(chunks)]
    done = [0] * chunks
    clock = head
    for action in order:
        j, mb = action.chunk, action.microbatch
        start = clock
        if action.backward:
            if j == top:
                if excursion is not None:
                    turn = min(turns[mb], done[top] - 1)
                    if turn >= 0 and forward_end[top][turn] + excursion > start:
                        start = forward_end[top][turn] + excursion
            elif backward_end[j + 1][mb] + down[j] > start:
                start = backward_end[j + 1][mb] + down[j]
            clock = start + backward[j]
            backward_end[j][mb] = clock
        else:
            if j > 0 and forward_end[j - 1][mb] + up[j - 1] > start:
                start = forward_end[j - 1][mb] + up[j - 1]
            clock = start + forward[j]
            forward_end[j][mb] = clock
            done[j] += 1
    return clock + drain


@dataclass
class SuffixBounds:
    """For every virtual stage u and first layer x: bounds over every split of layers [x, L) into stages u, u+1, ...

    `chain[u][x]`: the least sum of (forward + backward + 2 x send) over the stages, what one micro-batch's round trip
    through them takes at least. `reach[u][x]`: the least, over splits, of the largest (forwards and sends before
    stage t) + m x stage t's work + its tail: its stay-on-one-stage path measured from stage u's first forward.
    `relay[u][x]` (one chunk per stage): the same with the way back (backwards and sends below t) instead of the tail.
    math.inf: no split fits.
    """

    chain: list[list[float]]
    reach: list[list[float]]
    relay: list[list[float]] | None

    @classmethod
    def build(cls, cost: RangeCost, *, virtual: int, layers: int, microbatches: int, one_chunk: bool) -> SuffixBounds:
        m, inf = microbatches, math.inf
        chain = [[inf] * (layers + 1) for _ in range(virtual + 1)]
        reach = [[inf] * (layers + 1) for _ in range(virtual + 1)]
        relay = [[inf] * (layers + 1) for _ in range(virtual + 1)] if one_chunk else None
        for u in range(virtual - 1, -1, -1):
            later = virtual - 1 - u
            for x in range(u, layers - later):
                best_chain = best_reach = best_relay = inf
                stops = range(layers, layers + 1) if later == 0 else range(x + 1, layers - later + 1)
                for y in stops:
                    costs = cost(u, x, y)
                    if costs is None:
                        continue
                    forward, backward, send, tail = costs
                    work = forward + backward
                    if later == 0:
                        here_chain, here_reach, here_relay = work, m * work + tail, m * work
                    else:
                        here_chain = work + 2 * send + chain[u + 1][y]
                        here_reach = max(m * work + tail, forward + send + reach[u + 1][y])
                        here_relay = max(m * work, work + 2 * send + relay[u + 1][y]) if relay is not None else inf
                    best_chain = min(best_chain, here_chain)
                    best_reach = min(best_reach, here_reach)
                    best_relay = min(best_relay, here_relay)
                chain[u][x], reach[u][x] = best_chain, best_reach
                if relay is not None:
                    relay[u][x] = best_relay
        return cls(chain, reach, relay)

    @property
    def root_s(self) -> float:
        """A lower bound on the step of any split of the whole model (math.inf: none fits)."""
        return max(self.reach[0][0], self.relay[0][0] if self.relay is not None else 0.0)
