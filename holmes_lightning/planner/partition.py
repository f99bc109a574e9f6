"""Layers per stage: exact dynamic programming over contiguous splits, or a uniform split.

The DP minimises the schedule's closed form (see `objective`) over every split of the layer list into `pp`
contiguous stages. That objective is not additive (it mixes a sum and two maxima), so each DP cell keeps the Pareto
front of (slowest stage, largest exposed sync, sum) over its prefixes, which keeps the search exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageCost:
    """One stage's seconds for one candidate layer range."""

    compute_s: float  # forward + backward of one micro-batch
    send_s: float  # its output to the next stage, one direction, one micro-batch (0 for the last stage)
    exposed_sync_s: float  # DP sync per step that backward does not hide


StageCostFn = Callable[[int, int, int], "StageCost | None"]  # (stage, first layer, stop layer); None: does not fit


def objective(costs: Sequence[StageCost], microbatches: int, chunks: int = 1) -> float:
    """Predicted step seconds in closed form: (m - 1) x slowest stage + fill/drain + transfers + largest sync.

    For GPipe and 1F1B with equal stages this is (m + p - 1) x stage time; with `chunks` virtual stages per device
    (interleaved) the fill/drain shrinks to sum / chunks.
    """
    slowest = max(c.compute_s for c in costs)
    fill = sum(c.compute_s for c in costs) / chunks
    transfers = 2 * sum(c.send_s for c in costs)
    return (microbatches - 1) * slowest + fill + transfers + max(c.exposed_sync_s for c in costs)


def best_partition(
    cost: StageCostFn, num_layers: int, pp: int, microbatches: int, chunks: int = 1, min_layers: int = 1
) -> tuple[int, ...] | None:
    """Layers per stage minimising `objective`, each stage at least `min_layers`; None if no split fits."""
    # front[j]: non-dominated (slowest, sync, sum, start, parent) over splits of layers [0, j) into s + 1 stages
    front: dict[int, list[tuple]] = {0: [(0.0, 0.0, 0.0, 0, None)]}
    for stage in range(pp):
        later = min_layers * (pp - stage - 1)
        new_front: dict[int, list[tuple]] = {}
        for stop in range(min_layers * (stage + 1), num_layers - later + 1):
            entries = []
            for start, prefixes in front.items():
                if stop - start < min_layers:
                    continue
                c = cost(stage, start, stop)
                if c is None:
                    continue
                added = c.compute_s / chunks + 2 * c.send_s
                for entry in prefixes:
                    slowest, sync, total = max(entry[0], c.compute_s), max(entry[1], c.exposed_sync_s), entry[2] + added
                    entries.append((slowest, sync, total, start, entry))
            if entries:
                new_front[stop] = _pareto(entries)
        front = new_front
    finals = front.get(num_layers)
    if not finals:
        return None
    best = min(finals, key=lambda e: (microbatches - 1) * e[0] + e[1] + e[2])
    stops = [num_layers]
    while best[4] is not None and best[4][4] is not None:
        stops.append(best[3])
        best = best[4]
    bounds = [0, *reversed(stops)]
    return tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))


def uniform_partition(num_layers: int, parts: int) -> tuple[int, ...]:
    """Equal layer counts, the first stages taking one more when the division is not exact."""
    base, extra = divmod(num_layers, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def _pareto(entries: list[tuple]) -> list[tuple]:
    """Entries no other entry beats on all of (slowest, sync, sum)."""
    kept: list[tuple] = []
    for entry in sorted(entries, key=lambda e: e[:3]):
        if not any(k[0] <= entry[0] and k[1] <= entry[1] and k[2] <= entry[2] for k in kept):
            kept.append(entry)
    return kept
