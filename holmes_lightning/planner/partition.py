"""Layers per (virtual) stage: branch and bound over every contiguous split, ranked by the simulated step.

Virtual stages are assigned layers front to back. A partial split's lower bound is the largest of:

- per assigned virtual stage, its path (`bounds.one_chunk_path_s` over its chunk's actions; with several chunks per
  stage the other chunks' actions are left out, which only shortens it): the climb above it bounded by the least
  round trip through the layers left, cycles down to the virtual stages just below, then the way down;
- per stage whose chunks are all assigned, its path with the hops between its chunks (`bounds.stage_path_s`);
- every action of a stage after its first forward, and on NCCL the transfers GPipe and 1F1B idle for between them
  (`OneChunkWalk.gaps`, in the paths too); with several chunks per stage, the layers left shared out over the
  stages that still get some (`bounds.water_level_s`);
- per assigned virtual stage, when its last forward ends at least (after the previous virtual stage's, and after
  the link carried the m - 1 before it one at a time), then the backwards after it in its order and its drain;
- the suffix tables' bound for the layers left (`bounds.SuffixBounds`);
- once a search has run long (`PATHS_AFTER` partial splits), or from the start where earlier searches of the same
  schedule order found paths (`PATHS_KNOWN`) or where any split under the bar will do (`first`), per critical path
  of a split simulated so far (in this search or another of the same schedule order, `cuts`), its length over the
  virtual stages placed plus the least any ranges of the layers left give it: the queueing between stages the other
  bounds miss.

Where the plain subtrees from a virtual stage took the search many partial splits each so far (`ENUMERATION_NODES`),
or anywhere once the search has run longer still (`WAYS_AFTER`; `KNOWN_WAYS_AFTER` where its paths bound from the
start), a partial split whose layers left have at most `MOST_WAYS` ways to go enumerates them with every
path's length summed along each (`PathTables.completions`): only the ways that no path takes to `bar` are expanded,
the paths coupled (the layers left cannot dodge each path on its own). Before that, the best of those ways are
simulated (`PROBES`) and their critical paths added, which often leaves none. The children of a partial split that
would each enumerate are enumerated together first, and those left no way are not visited (`_wayless`). Under a
memory ceiling (the least-memory pass) the enumerations leave out the ranges that alone go over it.

A virtual stage's backward is costed at the checkpointing its stage needs for the chunks assigned so far
(`Candidate.level`); later chunks can only raise that level, so the bounds hold, and a finished split with several
chunks per stage is simulated at its final levels.

A zero-bubble schedule's backwards count in these paths as their input passes (`Candidate.gradient_s`), what the
stage below waits for; its weight passes, which nothing waits for, count only in their own stage's work and walks
(`bounds.PathShapes`), so the bounds hold.

A branch whose bound cannot beat `bar` is cut; every split that survives to the end is simulated
(`Candidate.step_s`). So the split returned has the least simulated step, or none if no split gets below `bar`.
A stage's work only grows with the layers of a range, and without a memory ceiling (or with one checkpointing level)
so does its memory: once a range's stage alone reaches `bar` or the memory limit, no longer range is tried.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from holmes_lightning.planner.bounds import ROUNDING, SuffixBounds, one_chunk_path_s, stage_path_s, water_level_s
from holmes_lightning.planner.candidate import Candidate
from holmes_lightning.planner.cuts import CriticalPaths, PathTables, critical_path

REBUILD = 0.98  # rebuild the suffix tables for a search once the bar fell below this share of theirs
DESCENTS = 3  # cycles down to this many virtual stages below one count in its path bound
PROGRESS_NODES = 1024  # partial splits between checks whether a progress report is due
PATHS_AFTER = 2000  # partial splits a search visits before it bounds by critical paths (`cuts`) too
PATHS_KNOWN = 2  # a step search whose pool starts with this many paths (found before it) bounds by them at once
PATHS_TRIAL, PATHS_USEFUL = 2000, 0.1  # a search for any split keeps them if they cut this many children a call
WAYS_AFTER = 20_000  # partial splits a search visits before it enumerates the ways left (`_probe`) wherever it may
KNOWN_WAYS_AFTER = 2000  # the same for a search whose paths bound from its start (`PATHS_KNOWN`, `first`)
SUBTREES_SEEN = 4  # plain subtrees from a virtual stage a search counts before it may enumerate the ways left there
ENUMERATION_NODES = 500  # partial splits a plain subtree takes on average where enumerating (`_probe`) pays
MOST_WAYS = 1_000_000  # splits of the layers left at most, for a search to enumerate them
MOST_LENGTHS = 4_000_000  # (way, path) lengths one enumeration may hold at once
RETRY = 64  # after an enumeration over that, the splits left must be this many times fewer to try again
PROBES = 8  # ways simulated per enumeration, best first, each adding its critical path


@dataclass
class PartitionStats:
    """What one or more partition searches did; `report`, if given, gets a line on how a search goes at most every
    `report_every_s` seconds (`progress`), so a long search shows it is moving."""

    nodes: int = 0
    cut: int = 0
    simulated: int = 0
    too_big: int = 0
    report: Callable[[str], None] | None = None
    report_every_s: float = 10.0
    reported_at: float = field(default_factory=time.monotonic)

    def progress(self, describe: Callable[[], str]) -> None:
        """Report `describe()` if a report is due."""
        if self.report is not None and time.monotonic() - self.reported_at >= self.report_every_s:
            self.report(describe())
            self.reported_at = time.monotonic()


@dataclass
class _Path:
    """The split so far, per virtual stage: seconds, stop, and sums over the virtual stages before it."""

    forward: list[float] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)  # what the virtual stage before waits for (`gradient_s`)
    weight: list[float] = field(default_factory=list)  # the rest of the backward: zero-bubble weight passes
    send: list[float] = field(default_factory=list)
    stops: list[int] = field(default_factory=list)
    drains: list[float] = field(default_factory=list)  # from its last backward to the step's end, at least
    head: list[float] = field(default_factory=lambda: [0.0])  # head[v]: forwards and sends before virtual stage v
    trip: list[float] = field(default_factory=lambda: [0.0])  # trip[v]: work and both sends of virtual stages < v
    down: list[float] = field(default_factory=lambda: [0.0])  # down[v]: backwards and sends of virtual stages < v
    last_forward: list[float] = field(default_factory=list)  # when its last micro-batch's forward ends, at least
    # per stage, running sums of one micro-batch's every pass through its assigned virtual stages (0.0 first)
    stage_work: defaultdict[int, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0.0]))
    tails: dict[int, float] = field(default_factory=dict)  # per complete stage: its exposed sync and optimizer step

    def start(self, v: int) -> int:
        return self.stops[v - 1] if v > 0 else 0

    def ranges(self, virtual_stages: Iterable[int]) -> list[tuple[int, int]]:
        """The [start, stop) layers of those virtual stages (placed ones)."""
        return [(self.start(u), self.stops[u]) for u in virtual_stages]


@dataclass
class _Child:
    """Virtual stage `v` holding layers [start, stop) after a partial split: its seconds and a cheap bound.

    `tail` is set when it completes its stage; `drain` bounds the way from its last backward to the step's end.
    """

    v: int
    stage: int
    start: int
    stop: int
    forward: float
    backward: float
    weight: float
    send: float
    tail: float | None
    drain: float
    bound: float
    last_forward: float

    def push(self, path: _Path) -> None:
        path.forward.append(self.forward)
        path.backward.append(self.backward)
        path.weight.append(self.weight)
        path.send.append(self.send)
        path.stops.append(self.stop)
        path.drains.append(self.drain)
        path.head.append(path.head[-1] + self.forward + self.send)
        path.trip.append(path.trip[-1] + self.forward + self.backward + 2 * self.send)
        path.down.append(path.down[-1] + self.backward + self.send)
        path.last_forward.append(self.last_forward)
        work = path.stage_work[self.stage]
        work.append(work[-1] + (self.forward + self.backward + self.weight))
        if self.tail is not None:
            path.tails[self.stage] = self.tail

    def pop(self, path: _Path) -> None:
        path.stage_work[self.stage].pop()
        for values in (
            path.forward,
            path.backward,
            path.weight,
            path.send,
            path.stops,
            path.drains,
            path.head,
            path.trip,
            path.down,
            path.last_forward,
        ):
            values.pop()


def uniform_partition(num_layers: int, parts: int) -> tuple[int, ...]:
    """Equal layer counts, the first stages taking one more when the division is not exact."""
    base, extra = divmod(num_layers, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def split_chunks(per_stage: Sequence[int], located: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """Each stage's layer count split into near-equal chunks, listed in virtual-stage order (`located[v]`: the stage
    and chunk of virtual stage v, `Candidate.located`)."""
    chunks = len(located) // len(per_stage)
    pieces = [uniform_partition(count, chunks) for count in per_stage]
    return tuple(pieces[stage][chunk] for stage, chunk in located)


def suffix_bounds(candidate: Candidate, bar: float = math.inf) -> SuffixBounds:
    """The candidate's suffix tables over splits that could get below `bar`."""
    return SuffixBounds.build(
        candidate.range_cost,
        virtual=candidate.virtual,
        layers=candidate.num_layers,
        microbatches=candidate.microbatches,
        walks=candidate.shapes.walks,
        bar=bar,
    )


def search_partition(
    candidate: Candidate,
    bar: float,
    stats: PartitionStats,
    tables: SuffixBounds | None = None,
    *,
    first: bool = False,
    paths: CriticalPaths | None = None,
    lowering: float | None = None,
) -> tuple[tuple[int, ...], float] | None:
    """The split with the least simulated step below `bar`, and that step (None: no split gets below `bar`);
    `first`: the first split found below `bar` instead; `lowering` (bytes): every split found below `bar` lowers the
    candidate's memory ceiling to its peak less `lowering` and the search goes on under it, `bar` kept: the last found
    takes the least memory, to `lowering`; `paths`: critical paths of the candidate's schedule order found so far, to
    bound by (`cuts`; an empty pool gets the uniform split's) and to add those of the splits simulated to."""
    if tables is None or bar < tables.bar * REBUILD:
        tables = suffix_bounds(candidate, bar)
    sharing = candidate.sharing
    if candidate.virtual == 1 or (sharing is not None and sharing.contended(candidate.layout.pp)):
        paths = None  # one stage has no path to bound; shared cores stretch actions beyond what a path counts
    elif paths is not None and not paths.found:  # a first path to bound by: the uniform split's
        paths.add(critical_path(candidate, uniform_partition(candidate.num_layers, candidate.virtual)))
    search = _Search(candidate, tables, stats, bar, first, paths, lowering)
    search.extend(_Path(), 0, 0.0)
    return search.best


class _Search:
    def __init__(
        self,
        candidate: Candidate,
        tables: SuffixBounds,
        stats: PartitionStats,
        bar: float,
        first: bool,
        paths: CriticalPaths | None,
        lowering: float | None,
    ):
        self.candidate, self.tables, self.stats, self.bar, self.first = candidate, tables, stats, bar, first
        self.lowering = lowering
        self.paths, self.cuts, self.began = paths, None, stats.nodes  # `cuts`: built once the search runs long
        # or at once in a step search with paths of earlier searches, and in any search for a first split, which also
        # enumerate sooner (the least-memory pass waits: its course picks which of the plans within tolerance it keeps)
        started = paths is not None and lowering is None and (first or len(paths.found) >= PATHS_KNOWN)
        self.paths_after, self.ways_after = (0, KNOWN_WAYS_AFTER) if started else (PATHS_AFTER, WAYS_AFTER)
        self.tried_paths = self.cut_by_paths = 0  # calls to `cuts`, and children they alone cut
        self.best: tuple[tuple[int, ...], float] | None = None
        self.pp, self.chunks, self.virtual = candidate.layout.pp, candidate.chunks, candidate.virtual
        self.m, self.layers = candidate.microbatches, candidate.num_layers
        self.chunk_costs: dict[tuple, tuple[float, float, float, float, float] | None] = {}
        # a virtual stage's path less its head follows from its range: its costs do (one chunk per stage), and no
        # cycle down counts (no stage runs a forward after a backward, as in GPipe)
        self.ranged_paths = self.chunks == 1 and all(turn < 0 for turns in candidate.shapes.descents for turn in turns)
        # a range too big stays so with more layers, unless more of them could turn on checkpointing that fits a ceiling
        self.monotone_memory = candidate.memory_ceiling is None or len(candidate.checkpointing) == 1
        # per virtual stage v, the plain (not enumerated) subtrees from it: how many, and their partial splits
        self.plain_subtrees, self.plain_nodes = [0] * (self.virtual + 1), [0] * (self.virtual + 1)
        self.invalid: np.ndarray | None = None  # the ranges the enumerations leave out, once they run (`_enumerate`)

    def extend(
        self, path: _Path, v: int, bound: float, ways: np.ndarray | None = None, most_ways: int = MOST_WAYS
    ) -> None:
        """Try every layer range for virtual stage `v`, cheapest bound first; the path bounds (the costly ones) are
        added when a child is about to be expanded. `ways`: the only stops of virtual stages v, v + 1, ... left
        (`PathTables.completions`; None: any); `most_ways`: the most splits of the layers left to enumerate."""
        self.stats.nodes += 1
        if self.stats.nodes % PROGRESS_NODES == 0:
            self.stats.progress(self._describe)
        if v == self.virtual:
            self._finish(path)
            return
        if ways is None and self._enumerates(v, path.start(v), most_ways):
            ways = self._probe(path, v, path.start(v))
            if self.first and self.best is not None:
                return
            if ways is None:  # too many to enumerate: not again until far fewer splits are left
                most_ways = math.comb(self.layers - path.start(v) - 1, self.virtual - 1 - v) // RETRY
        if ways is not None:  # an enumerated subtree
            self._expand(path, v, bound, ways, most_ways)
            return
        began = self.stats.nodes
        self._expand(path, v, bound, None, most_ways)
        self.plain_nodes[v] += self.stats.nodes - began
        self.plain_subtrees[v] += 1

    def _enumerates(self, v: int, start: int, most_ways: int) -> bool:
        """Whether a plain partial split whose virtual stage v starts at layer `start` enumerates the ways left."""
        if self.cuts is None or math.comb(self.layers - start - 1, self.virtual - 1 - v) > most_ways:
            return False
        return self.stats.nodes - self.began >= self.ways_after or self._worth_enumerating(v)

    def _worth_enumerating(self, v: int) -> bool:
        """Whether the plain subtrees from virtual stage v took this search `ENUMERATION_NODES` partial splits or more
        on average (over at least `SUBTREES_SEEN` of them): where enumerating the ways left is likely the quicker."""
        seen = self.plain_subtrees[v]
        return seen >= SUBTREES_SEEN and self.plain_nodes[v] >= ENUMERATION_NODES * seen

    def _expand(self, path: _Path, v: int, bound: float, ways: np.ndarray | None, most_ways: int) -> None:
        """`extend`'s children of a partial split that ends before virtual stage v."""
        start, later = path.start(v), self.virtual - 1 - v
        stops = range(self.layers, self.layers + 1) if later == 0 else range(start + 1, self.layers - later + 1)
        if ways is not None:
            stops = sorted(set(ways[:, 0].tolist()))
        stage, children = self.candidate.located[v][0], []
        for stop in stops:
            costs = self._costs(path, v, start, stop)
            if costs is None:
                if self.monotone_memory:  # and more so with more layers
                    self.stats.too_big += len(stops) - stops.index(stop)
                    break
                self.stats.too_big += 1
                continue
            forward, backward, _, _, weight = costs
            busy = self.m * (path.stage_work[stage][-1] + forward + backward + weight)
            if (path.head[stage] + busy) * (1 - ROUNDING) >= self.bar:  # and more so with more layers
                self.stats.cut += len(stops) - stops.index(stop)
                break
            children.append(self._child(path, v, start, stop, bound, costs))
        if children and ways is None and self.paths is not None:
            self._bound_by_paths(path, v, start, children)
        children.sort(key=lambda child: child.bound)
        wayless = self._wayless(path, v, children, most_ways) if ways is None else set()
        for tried, child in enumerate(children):
            if child.bound * (1 - ROUNDING) >= self.bar:
                self.stats.cut += len(children) - tried
                return
            full = max(child.bound, self._virtual_path_s(path, child))
            if self.chunks > 1 and v < self.virtual - 1:
                full = max(full, self._load_s(path, child))
            if child.tail is not None and self.chunks > 1:
                full = max(full, self._stage_path_s(path, child))
            if full * (1 - ROUNDING) >= self.bar:
                self.stats.cut += 1
                continue
            if child.stop in wayless:  # its own enumeration would find no way left
                self.stats.nodes += 1
                continue
            child.push(path)
            self.extend(path, v + 1, full, None if ways is None else ways[ways[:, 0] == child.stop, 1:], most_ways)
            child.pop(path)
            if self.first and self.best is not None:
                return

    def _wayless(self, path: _Path, v: int, children: list[_Child], most_ways: int) -> set[int]:
        """The stops of those `children` that would enumerate the ways left (`_probe`) and find none, told by one
        enumeration for them all: every path bounds every split and the bar only falls, so none would find one later."""
        if v + 1 >= self.virtual:
            return set()
        stops = [
            child.stop
            for child in children
            if child.bound * (1 - ROUNDING) < self.bar and self._enumerates(v + 1, child.stop, most_ways)
        ]
        if len(stops) < 2:
            return set()
        ranges = path.ranges(range(v))
        ways = self._enumerate(ranges, v, path.start(v), firsts=stops)
        return set() if ways is None else set(stops) - set(ways[:, 0].tolist())

    def _probe(self, path: _Path, v: int, start: int) -> np.ndarray | None:
        """The ways to split the layers left that no critical path takes to the bar (`PathTables.completions`; None:
        too many to enumerate), after simulating up to `PROBES` of them, best first, each adding its critical path
        (and, if faster, becoming the best split)."""
        ranges = path.ranges(range(v))
        placed = [b - a for a, b in ranges]
        for _ in range(PROBES):
            ways = self._enumerate(ranges, v, start)
            if ways is None or len(ways) == 0:
                return ways
            stops = (start, *ways[0].tolist())
            counts = (*placed, *(b - a for a, b in itertools.pairwise(stops)))
            self.stats.simulated += 1
            found = critical_path(self.candidate, counts)
            if found is None:  # over memory: the plain search says so
                return ways
            self.paths.add(found)
            step = self.candidate.step_s(counts)
            if step < self.bar:
                self._found(counts, step)
                if self.first:
                    return ways
        return self._enumerate(ranges, v, start)

    def _enumerate(
        self, ranges: list[tuple[int, int]], v: int, start: int, firsts: list[int] | None = None
    ) -> np.ndarray | None:
        """`PathTables.completions` under the bar, without the ranges that alone go over the memory ceiling (the
        tables leave out those over the limit, whatever the ceiling: under one, as in the least-memory pass, the
        fastest ways are often just over it)."""
        if self.invalid is None:
            self.invalid = self.cuts.invalid
            if self.candidate.memory_ceiling is not None:
                self.invalid = self.invalid + self._over_ceiling()
        return self.cuts.completions(ranges, v, start, self.bar, MOST_LENGTHS, firsts=firsts, invalid=self.invalid)

    def _over_ceiling(self) -> np.ndarray:
        """Per virtual stage, inf at the layer ranges [start, stop) that alone go over the memory ceiling, else 0."""
        over = np.zeros((self.virtual, self.layers + 1, self.layers + 1))
        for v, start in itertools.product(range(self.virtual), range(self.layers)):
            for stop in range(start + 1, self.layers + 1):
                if self.candidate.range_cost(v, start, stop) is None:
                    if self.monotone_memory:  # and more so with more layers
                        over[v, start, stop:] = np.inf
                        break
                    over[v, start, stop] = np.inf
        return over

    def _bound_by_paths(self, path: _Path, v: int, start: int, children: list[_Child]) -> None:
        """Raise the children's bounds to the critical paths' (`cuts`) from `PATHS_AFTER` partial splits on. A search
        for any split under a bar that does not fall (`first`, `lowering`: the least-memory pass) drops them if in its
        first `PATHS_TRIAL` calls they cut fewer than `PATHS_USEFUL` children a call that nothing else would."""
        if self.cuts is None:
            if self.stats.nodes - self.began < self.paths_after:
                return
            self.cuts = PathTables.of(self.candidate, self.paths)
        stops = [child.stop for child in children]
        by_paths = self.cuts.children_s(path.ranges(range(v)), v, start, stops)
        if by_paths is None:
            return
        self.tried_paths += 1
        for child, cut in zip(children, by_paths.tolist(), strict=True):
            if cut * (1 - ROUNDING) >= self.bar > child.bound * (1 - ROUNDING):
                self.cut_by_paths += 1
            child.bound = max(child.bound, cut)
        steady = self.first or self.lowering is not None  # a bar that does not fall
        if steady and self.tried_paths == PATHS_TRIAL and self.cut_by_paths < PATHS_USEFUL * PATHS_TRIAL:
            self.paths = self.cuts = None

    def _describe(self) -> str:
        best = "none yet" if self.bar == math.inf else f"{self.bar:.4g} s"
        return (
            f"planning: splitting {self.candidate.describe()}; searches so far: {self.stats.nodes:,} partial splits "
            f"visited, {self.stats.simulated:,} simulated; the step to beat {best}"
        )

    def _costs(self, path: _Path, v: int, start: int, stop: int) -> tuple[float, float, float, float, float] | None:
        """(forward, backward, send, tail, weight) of virtual stage v holding layers [start, stop) after the path
        (None: its stage goes over the memory limit)."""
        if self.chunks == 1:
            return self.candidate.range_cost(v, start, stop)
        return self._chunk_costs(path, v, start, stop)

    def _child(
        self, path: _Path, v: int, start: int, stop: int, bound: float, costs: tuple[float, float, float, float, float]
    ) -> _Child:
        """Virtual stage v holding layers [start, stop), of `costs` (`_costs`)."""
        c, chunks, m = self.candidate, self.chunks, self.m
        stage, chunk = c.located[v]
        forward, backward, send, tail, weight = costs
        work = path.stage_work[stage][-1] + forward + backward + weight
        ends = 0.0
        if chunk == chunks - 1:  # the stage is complete: its tail follows its last action, chunk 0's last backward
            ends = path.down[v] - path.down[stage] + tail
        else:
            tail = None
        drain = ends if v == 0 else max(ends, path.drains[v - 1] + path.send[v - 1] + path.backward[v - 1])
        walk, below = c.shapes.walks[v], path.send[v - 1] if v else 0.0  # (its gaps: one chunk per stage only)
        busy = m * work + walk.waits_s(forward, backward, send, below)  # after its first action, and what it idles for
        bound = max(bound, path.head[stage] + busy + (tail or 0.0))
        last_forward = path.head[v] + m * forward  # its forwards follow its first one, and the last arrives after
        if v:  # the one before sent it, and the link carried the m - 1 before it one at a time
            first = path.head[v - 1] + path.forward[v - 1]
            last_forward = max(last_forward, max(path.last_forward[v - 1], first + (m - 1) * below) + below + forward)
        closing = walk.closing * backward + walk.waits_s(forward, backward, send, below, closing=True)
        bound = max(bound, last_forward + closing + drain)
        if v < self.virtual - 1:
            next_head = path.head[v] + forward + send
            bound = max(
                bound,
                next_head + self.tables.reach[v + 1][stop],
                next_head + drain + send + backward + self.tables.relay[v + 1][stop],
            )
        return _Child(v, stage, start, stop, forward, backward, weight, send, tail, drain, bound, last_forward)

    def _chunk_costs(
        self, path: _Path, v: int, start: int, stop: int
    ) -> tuple[float, float, float, float, float] | None:
        """(forward, backward, send, tail, weight) of virtual stage v holding layers [start, stop) after its stage's
        earlier chunks (several chunks per stage); tail 0 until the stage is complete. Kept per v and its stage's
        ranges so far, which fix them (each earlier chunk's passes follow from its range and those before it)."""
        c = self.candidate
        stage, chunk = c.located[v]
        ranges = path.ranges(c.own[stage][:chunk])
        ranges.append((start, stop))
        key = (v, *ranges)
        if key not in self.chunk_costs:
            self.chunk_costs[key] = self._new_chunk_costs(path, v, ranges)
        return self.chunk_costs[key]

    def _new_chunk_costs(
        self, path: _Path, v: int, ranges: list[tuple[int, int]]
    ) -> tuple[float, float, float, float, float] | None:
        """`_chunk_costs` of virtual stage v, its stage's chunks so far over `ranges` (its own last)."""
        c = self.candidate
        stage, chunk = c.located[v]
        start, stop = ranges[-1]
        params = sum(c.param_bytes(a, b) for a, b in ranges)
        level = c.level(stage, params, ranges)
        if level is None:
            return None
        forward, backward = c.forward_s(stage, start, stop), c.gradient_s(stage, start, stop, level)
        weight = c.weight_s(stage, start, stop)
        tail = 0.0
        if chunk == self.chunks - 1:  # its last chunk: the stage is complete
            work = path.stage_work[stage][-1] + forward + backward + weight
            frozen = sum(c.frozen_bytes(a, b) for a, b in ranges)
            tail = c.tail_s(stage, params, sum(b - a for a, b in ranges), work, frozen)
        return forward, backward, c.send_s(v, stop), tail, weight

    def _load_s(self, path: _Path, child: _Child) -> float:
        """Several chunks per stage, `child` not the last virtual stage: the stages with chunks left share the layers
        left, each after its own first forward and the work it has (`water_level_s`)."""
        c, m, v, stage, stop = self.candidate, self.m, child.v, child.stage, child.stop
        work = path.stage_work[stage][-1] + child.forward + child.backward + child.weight
        next_head = path.head[v] + child.forward + child.send
        bases, rates = [], []
        for s, own in enumerate(c.own):
            if own[-1] <= v:  # complete: its whole path is in the bound already
                continue
            known = work if s == stage else path.stage_work[s][-1]
            bases.append((path.head[s] if s <= v else next_head) + m * known)
            rates.append(m * c.slowdown[s])
        return water_level_s(bases, rates, c.base_work_s(stop, self.layers))

    def _virtual_path_s(self, path: _Path, child: _Child) -> float:
        """`one_chunk_path_s` of `child`'s chunk, the climb above bounded by the least round trip left.

        Without cycles down, the path less its head and drain depends only on the child's range (the tables hold it).
        """
        v, shapes, paths = child.v, self.candidate.shapes, self.tables.paths
        walk = shapes.walks[v]
        excursion = None if v == self.virtual - 1 else 2 * child.send + self.tables.chain[v + 1][child.stop]
        if v == 0:
            key = (v, child.start, child.stop)
            if key not in paths:
                paths[key] = walk.path_s(child.forward, child.backward, excursion, child.weight, child.send)
            return paths[key] + child.drain
        if self.ranged_paths:
            key = (v, child.start, child.stop)
            if key not in self.tables.climbs:
                self.tables.climbs[key] = one_chunk_path_s(
                    walk, child.forward, child.backward, excursion, (), child.weight, child.send, path.send[v - 1]
                )
            return path.head[v] + self.tables.climbs[key] + child.drain
        descents = [(shapes.descents[u], path.trip[v] - path.trip[u]) for u in range(max(0, v - DESCENTS), v)]
        path_s = one_chunk_path_s(
            walk, child.forward, child.backward, excursion, descents, child.weight, child.send, path.send[v - 1]
        )
        return path.head[v] + path_s + child.drain

    def _stage_path_s(self, path: _Path, child: _Child) -> float:
        """`stage_path_s` of the stage `child` completes (several chunks), with the hops between its chunks."""
        c, v, stage = self.candidate, child.v, child.stage
        excursion = None if v == self.virtual - 1 else 2 * child.send + self.tables.chain[v + 1][child.stop]
        own = c.own[stage][:-1]
        up, down = [], []
        for u, w in zip(own, c.own[stage][1:], strict=True):  # hops from chunk u to the next, w, through the
            sends = sum(path.send[t] for t in range(u, w))  # virtual stages between (all assigned)
            up.append(sends + sum(path.forward[t] for t in range(u + 1, w)))
            down.append(sends + sum(path.backward[t] for t in range(u + 1, w)))
        weights = [path.weight[u] for u in own] + [child.weight]
        walk = stage_path_s(
            order=c.shapes.orders[stage],
            forward=[path.forward[u] for u in own] + [child.forward],
            backward=[path.backward[u] for u in own] + [child.backward],
            weight=weights,
            excursion=excursion,
            turns=c.shapes.turns,
            up=up,
            down=down,
        )
        trailing = sum(weights[j] for j in c.shapes.trailing[stage])  # the weight passes after the last input pass
        return path.head[stage] + walk + max(child.tail + trailing, path.drains[stage] if stage < v else 0.0)

    def _finish(self, path: _Path) -> None:
        counts = tuple(path.stops[u] - path.start(u) for u in range(self.virtual))
        tails = [path.tails[s] for s in range(self.pp)]
        c = self.candidate
        if self.chunks > 1 and len(c.checkpointing) > 1:  # a stage's later chunks may have raised its level
            step = c.step_s(counts)
        else:
            early = [c.early_s(v, path.stops[v]) for v in range(self.virtual)]
            backward, weight = path.backward, None
            if c.splits:  # the path holds the input passes, the weight passes apart
                backward, weight = [b + w for b, w in zip(backward, path.weight, strict=True)], path.weight
            step = c.replay.step_s(path.forward, backward, path.send, tails, c.sharing, early, c.buffered, weight)
        self.stats.simulated += 1
        if self.cuts is not None and step is not None:  # a long search's leaves
            self.paths.add(critical_path(c, counts))
        if step is not None and step < self.bar and self._fits(counts):
            self._found(counts, step)

    def _fits(self, counts: tuple[int, ...]) -> bool:
        """With `lowering`, whether the split fits the memory ceiling as lowered since its ranges were placed."""
        return self.lowering is None or self.candidate.peak_bytes(counts) <= self.candidate.memory_ceiling

    def _found(self, counts: tuple[int, ...], step: float) -> None:
        """A split under the bar: the best so far; the bar falls to its step, or with `lowering` the memory ceiling
        to its peak less that (the costs kept under the ceiling before dropped)."""
        self.best = (counts, step)
        if self.lowering is None:
            self.bar = step * (1 - 1e-9)
            return
        self.candidate.lower_ceiling(counts, self.lowering)
        self.chunk_costs.clear()
        self.invalid = None
