"""The search over candidates (layout x micro-batch count x sharding) and their splits, bounded by the best so far.

1. Every candidate's uniform split (or the requested split) is simulated; then the balanced splits (least busy
   busiest stage, `balanced_partition`; with several chunks per stage also `balanced_stages`) of each candidate
   with many splits whose one-pass bound is under the best so far, those near the fastest improved layer by layer
   (`descend`): a first incumbent near the optimum, cheaply.
2. A one-pass bound, then the least bound over all splits (`SuffixBounds`), cuts candidates that cannot beat it.
3. The rest, lowest bound first, are split by branch and bound (`partition.search_partition`).

A candidate replaces the incumbent only if its step is lower, or equal with an earlier `preference` (FSDP before
replicas, then the order candidates were listed in). Nothing that is cut could have replaced it, so the result is the
best plan of all candidates under the cost model.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from holmes_lightning.planner.bounds import SuffixBounds, water_level_s
from holmes_lightning.planner.candidate import Candidate
from holmes_lightning.planner.cuts import CriticalPaths, critical_path, path_key
from holmes_lightning.planner.partition import (
    ROUNDING,
    PartitionStats,
    search_partition,
    split_chunks,
    suffix_bounds,
    uniform_partition,
)

SEEDED_SPLITS = 100_000  # candidates with fewer splits than this are searched from their uniform split alone
DESCEND_WITHIN = 0.15  # balanced splits this share slower than the fastest one are not descended
TIE = 1e-9  # relative: steps this close count as equal, and the earlier preference wins


@dataclass
class SearchStats:
    """What the search did: candidates, how many a bound cut before splitting, and the split searches."""

    layouts: int = 0
    candidates: int = 0
    seeded: int = 0
    cut_quick: int = 0
    cut_tables: int = 0
    searched: int = 0
    memory_searches: int = 0
    partitions: PartitionStats = field(default_factory=PartitionStats)

    @classmethod
    def reporting(cls, report: Callable[[str], None] | None, every_s: float = 10.0) -> SearchStats:
        """Stats whose searches send `report` (None: nothing) a line on how they go at most every `every_s` s."""
        return cls(partitions=PartitionStats(report=report, report_every_s=every_s))

    def summary(self) -> str:
        p = self.partitions
        return "\n".join(
            [
                f"search: {self.layouts} layouts (NIC group orders, interchangeable groups once, x DP sizes), "
                f"{self.candidates} candidates (x micro-batch counts x shardings)",
                f"  first incumbent: the uniform (or requested) split of {self.seeded} candidates simulated",
                f"  cut before splitting: {self.cut_quick} by a one-pass bound (a micro-batch's round trip, the "
                f"busiest stage's share), {self.cut_tables} by the least bound over all their splits",
                f"  split searches: {self.searched}; partial splits visited {p.nodes}, branches cut by their bound "
                f"{p.cut}, ranges over the memory limit {p.too_big}, whole splits simulated {p.simulated}",
                f"  less memory: {self.memory_searches} search for plans within the step tolerance of the fastest "
                f"under a memory ceiling, lowered below each plan it finds",
            ]
        )


@dataclass
class Found:
    """The best plan so far: its candidate, layers per virtual stage and simulated step."""

    step_s: float
    preference: tuple[int, ...]
    candidate: Candidate
    counts: tuple[int, ...]

    def bar(self, preference: tuple[int, ...]) -> float:
        """The step a candidate of this preference must get under to replace this plan."""
        return self.step_s * (1 - TIE) if preference > self.preference else self.step_s * (1 + TIE)


def search(
    candidates: list[tuple[tuple[int, ...], Candidate]],
    fixed: Callable[[Candidate], tuple[int, ...] | None],
    stats: SearchStats,
    infeasible: Callable[[Candidate, tuple[int, ...] | None], None],
    ceiling: float = math.inf,
    lower: dict[tuple[int, ...], float] | None = None,
    slack: float = 0.0,
    tables: dict[tuple[int, ...], SuffixBounds] | None = None,
    paths: dict[tuple, CriticalPaths] | None = None,
    lowering: float | None = None,
    descended: list[Found] | None = None,
) -> Found | None:
    """The best (candidate, split) of `candidates` (preference, candidate) with a step under `ceiling`; `fixed`: the
    requested split, if any.

    `infeasible(candidate, counts)` is told of every candidate whose split (None: every split) exceeds memory.
    `lower`, if given, gets per preference a lower bound on the candidate's step that holds for every split within
    `slack` (a share) of the best plan's step; the tables are built that much looser to give it, and a candidate
    whose split search finds no split under its bar gets that bar (every split of it takes as long or longer: the
    least-memory pass skips it where the bar is beyond the tolerance). `tables`: per preference, suffix tables to
    reuse where built for a bar no lower, and to fill with those of candidates without a memory ceiling (a ceiling
    only rules splits out, so those bound the same candidate under any ceiling; not the other way round). `paths`:
    per schedule order (`cuts.path_key`), the critical paths of the splits simulated, to bound splits by and to add
    to (a split's critical path bounds any split under any ceiling). `lowering` (bytes; the least-memory pass): every
    plan found under `ceiling` lowers the memory ceiling of the candidates to its peak less `lowering` and the search
    goes on under it, `ceiling` kept: the last plan found takes the least memory of all, to `lowering`. Only a
    candidate with a split under both ceilings (`_has_split`, a quick search for the first one) is searched that way,
    whose course decides the plan kept; most have none. `descended`, if given, gets the seeds the search descended,
    each as the plan it reached (for the least-memory pass to start from).
    """
    stats.candidates += len(candidates)
    best: Found | None = None
    memory = math.inf  # with `lowering`: the memory ceiling as lowered so far
    lower = {} if lower is None else lower

    def offer(preference: tuple[int, ...], candidate: Candidate, counts: tuple[int, ...], step: float) -> None:
        nonlocal best, memory
        if step < bar_of(preference):
            best = Found(step, preference, candidate, counts)
            if lowering is not None:  # and the candidates after it under its memory
                memory = candidate.lower_ceiling(counts, lowering)

    def bar_of(preference: tuple[int, ...]) -> float:
        return best.bar(preference) if best and lowering is None else ceiling

    def lowered(candidate: Candidate) -> Candidate:
        if lowering is not None:
            candidate.memory_ceiling = min(candidate.memory_ceiling, memory)
        return candidate

    for preference, candidate in candidates:
        lowered(candidate)
        counts = fixed(candidate) or uniform_partition(candidate.num_layers, candidate.virtual)
        step = candidate.step_s(counts)
        stats.seeded += 1
        if step is not None:
            offer(preference, candidate, counts, step)
        elif fixed(candidate) is not None:
            infeasible(candidate, counts)
        if fixed(candidate) is not None:
            lower[preference] = math.inf if step is None else step
    if any(fixed(candidate) is not None for _, candidate in candidates):
        return best
    quick = sorted((quick_bound(c), p, c) for p, c in candidates)
    if lowering is None:  # a better incumbent: balanced splits of candidates that may win, descended
        seeds = []
        for bound, preference, candidate in quick:
            if best is not None and bound >= best.step_s:
                break
            if math.comb(candidate.num_layers - 1, candidate.virtual - 1) < SEEDED_SPLITS:
                continue
            for counts, step in _balanced_seeds(candidate):
                offer(preference, candidate, counts, step)
                seeds.append((step, preference, candidate, counts))
        seeds_best = min((seed[0] for seed in seeds), default=math.inf)
        for step, preference, candidate, counts in sorted(seeds, key=lambda seed: seed[:2]):
            if step > seeds_best * (1 + DESCEND_WITHIN):
                break
            counts, step = descend(candidate, counts, step)
            offer(preference, candidate, counts, step)
            if descended is not None:
                descended.append(Found(step, preference, candidate, counts))
    survivors = []
    for bound, preference, candidate in quick:
        lower[preference] = bound
        bar = bar_of(preference)
        if bound * (1 - ROUNDING) >= bar:
            stats.cut_quick += 1
            continue
        kept = tables.get(preference) if tables is not None else None
        if kept is None or kept.bar < bar * (1 + slack):
            kept = suffix_bounds(candidate, bar * (1 + slack))
            if tables is not None and candidate.memory_ceiling is None:
                tables[preference] = kept
        root = lower[preference] = max(kept.root_s, bound)
        if kept.root_s == math.inf and bar == math.inf:
            infeasible(candidate, None)
        if root * (1 - ROUNDING) >= bar:
            stats.cut_tables += 1
            continue
        survivors.append((root, preference, candidate, kept))
    paths = {} if paths is None else paths
    if best is not None:
        paths.setdefault(path_key(best.candidate), CriticalPaths()).add(critical_path(best.candidate, best.counts))
    for root, preference, candidate, kept in sorted(survivors, key=lambda entry: entry[:2]):
        bar = bar_of(preference)
        if root * (1 - ROUNDING) >= bar:
            stats.cut_tables += 1
            continue
        stats.searched += 1
        stats.partitions.progress(partial(_next_search, candidate, best))
        pool = paths.setdefault(path_key(candidate), CriticalPaths())
        if lowering is not None and not _has_split(lowered(candidate), bar, stats, kept, pool):
            continue
        found = search_partition(lowered(candidate), bar, stats.partitions, kept, paths=pool, lowering=lowering)
        if found is not None:
            offer(preference, candidate, *found)
        elif bar == math.inf:
            infeasible(candidate, None)
        else:  # every split of it takes `bar` or longer
            lower[preference] = max(lower[preference], bar)
    return best


def _has_split(candidate: Candidate, bar: float, stats: SearchStats, tables: SuffixBounds, pool: CriticalPaths) -> bool:
    """Whether a split of `candidate` gets under `bar` and its memory ceiling, by a search for the first one (which
    bounds by `pool`'s paths from its start and enumerates sooner)."""
    return search_partition(candidate, bar, stats.partitions, tables, first=True, paths=pool) is not None


def _next_search(candidate: Candidate, best: Found | None) -> str:
    so_far = "none yet" if best is None else f"{best.step_s:.4g} s"
    return f"planning: splitting {candidate.describe()} next, best step {so_far} so far"


def _balanced_seeds(candidate: Candidate) -> list[tuple[tuple[int, ...], float]]:
    """The balanced splits that fit memory, with their simulated steps: `balanced_partition`'s, and with several
    chunks per stage `balanced_stages`' too (each descends to its own local optimum; either may be the better)."""
    splits = {balanced_partition(candidate)}
    if candidate.chunks > 1:
        splits.add(balanced_stages(candidate))
    return [(counts, step) for counts in sorted(splits) if (step := candidate.step_s(counts)) is not None]


def balanced_partition(candidate: Candidate) -> tuple[int, ...]:
    """The split whose busiest virtual stage is least busy: m x (its passes) + its waits on sends + its tail (one
    chunk per stage), a cheap proxy for the step, by dynamic programming over the ranges (memory and checkpointing
    left to the simulation)."""
    c, m = candidate, candidate.microbatches

    def busy(v: int, start: int, stop: int) -> tuple[float, float]:
        stage, walk = c.located[v][0], c.shapes.walks[v]
        forward, backward = c.forward_s(stage, start, stop), c.backward_s(stage, start, stop)
        passes = m * (forward + backward)
        down = c.send_s(v - 1, start) if v else 0.0
        seconds = passes + walk.waits_s(forward, backward - c.weight_s(stage, start, stop), c.send_s(v, stop), down)
        if c.chunks == 1:  # and what follows its last backward
            seconds += c.tail_s(
                stage, c.param_bytes(start, stop), stop - start, forward + backward, c.frozen_bytes(start, stop)
            )
        return passes, seconds

    return _least_busiest(c.virtual, c.num_layers, 1, busy)


def balanced_stages(candidate: Candidate) -> tuple[int, ...]:
    """Several chunks per stage: the layer counts per stage whose busiest stage (m x its passes + its tail: the sync
    of all its layers, which a slow NIC makes the larger share) is least busy, over ranges in stage order as if each
    stage held one, then each stage's count split into its chunks (`split_chunks`). A stage's load is the sum of its
    chunks', which a balance per virtual stage misses."""
    c, m = candidate, candidate.microbatches

    def busy(stage: int, start: int, stop: int) -> tuple[float, float]:
        passes = c.forward_s(stage, start, stop) + c.backward_s(stage, start, stop)
        tail = c.tail_s(stage, c.param_bytes(start, stop), stop - start, passes, c.frozen_bytes(start, stop))
        return m * passes, m * passes + tail

    return split_chunks(_least_busiest(c.layout.pp, c.num_layers, c.chunks, busy), c.located)


def _least_busiest(
    parts: int, layers: int, smallest: int, busy: Callable[[int, int, int], tuple[float, float]]
) -> tuple[int, ...]:
    """Layers per part of the split of `layers` into `parts` ranges of at least `smallest` layers whose busiest range
    is least busy, by dynamic programming; `busy(part, start, stop)`: a floor of the range's seconds that only grows
    with more layers, and its seconds."""
    least = [[math.inf] * (layers + 1) for _ in range(parts + 1)]
    stop_of = [[0] * (layers + 1) for _ in range(parts + 1)]
    least[parts][layers] = 0.0
    for part in range(parts - 1, -1, -1):
        later = (parts - 1 - part) * smallest  # layers the ranges after it need at least
        for start in range(part * smallest, layers - later - smallest + 1):
            for stop in range(start + smallest, layers - later + 1):
                floor, seconds = busy(part, start, stop)
                if floor >= least[part][start]:  # and more so with more layers
                    break
                if max(seconds, least[part + 1][stop]) < least[part][start]:
                    least[part][start], stop_of[part][start] = max(seconds, least[part + 1][stop]), stop
    stops = [0]
    for part in range(parts):
        stops.append(stop_of[part][stops[-1]])
    return tuple(b - a for a, b in itertools.pairwise(stops))


def descend(candidate: Candidate, counts: tuple[int, ...], step: float) -> tuple[tuple[int, ...], float]:
    """From `counts` (of step `step`), move one layer across a boundary while the best such move shortens the
    simulated step: a local optimum, which only sets the bar the exact search must beat."""
    while True:
        best = (counts, step)
        for v in range(len(counts) - 1):
            for shift in (1, -1):  # one layer from v + 1 to v, or from v to v + 1
                moved = list(counts)
                moved[v] += shift
                moved[v + 1] -= shift
                if min(moved[v], moved[v + 1]) < 1:
                    continue
                found = candidate.step_s(moved)
                if found is not None and found < best[1]:
                    best = (tuple(moved), found)
        if best[0] == counts:
            return counts, step
        counts, step = best


def quick_bound(candidate: Candidate) -> float:
    """A lower bound on any split's step in one pass: one micro-batch's round trip, or the stages' work shared out.

    Each layer takes at least its time on the layout's fastest stage, each boundary at least the smallest activation;
    m micro-batches of the whole model's work spread over the stages as evenly as their speeds allow.
    """
    pp, layers, m = candidate.layout.pp, candidate.num_layers, candidate.microbatches
    work = candidate.base_work_s(0, layers)
    round_trip = work + 2 * sum(candidate.least_send_s(v) for v in range(candidate.virtual))
    spread = water_level_s([0.0] * pp, [m * slowdown for slowdown in candidate.slowdown], work)
    return max(round_trip, spread)
