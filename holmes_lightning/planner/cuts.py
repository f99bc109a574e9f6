"""Lower bounds from simulated critical paths, for the partition search.

Which action of a step waits for which depends on the schedule, not on the split, so the critical path of one
simulated split (`simulate.CriticalPath`) is a chain of waits every split of that schedule has. Its length is linear in
the virtual stages' seconds (forward, input pass, weight pass, transfer, transfer less its early part), so for a
partial split it is at least its length over the virtual stages placed plus the least length any ranges of the layers
left give it over the rest: a shortest path over those ranges, kept per path, virtual stage and first layer
(`PathTables`). Its tail counts as the pipeline's closing collective plus shares of the stage's chunks that sum to
at most the tail (`Candidate.tail_share_s`). Every split a long search simulates lends its critical path to the
bounds of the splits after it (`CriticalPaths`, shared by the searches of one plan), so a split that waits the way
one already simulated waited is cut once that chain alone reaches the step to beat: the queueing between stages
that the path bounds of `bounds` miss. A partial split with few ways left to go can also have them enumerated, each
path's length summed along each way (`PathTables.completions`): a way survives only if every path leaves it under
the bar, which the per-path least over the layers left cannot tell. A few paths screen the ways first (those that cut
the most of what the screen let by so far), so all paths are summed only along the ways they leave.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from holmes_lightning.planner.bounds import ROUNDING
from holmes_lightning.planner.candidate import Candidate
from holmes_lightning.planner.simulate import CriticalPath

TERMS = 6  # per virtual stage: forward, input pass, weight pass, transfer, transfer less its early part, tail share
MOST_PATHS = 256  # critical paths kept per schedule order
SCREEN = 8  # paths checked first in an enumeration: those that cut the most ways the screen let by (`completions`)


@dataclass
class CriticalPaths:
    """The distinct critical paths found for one schedule order (one `Replay` and backend), at most `MOST_PATHS`:
    then a new one takes the place of the one that gave the largest bound to the fewest children (`used`, which
    halves at every such replacement, so the paths of a search's current region stay)."""

    found: list[CriticalPath] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per place: how many times its path was replaced
    used: np.ndarray = field(default_factory=lambda: np.zeros(0))
    seen: set[CriticalPath] = field(default_factory=set)
    revision: int = 0  # paths added so far

    def add(self, path: CriticalPath | None) -> None:
        """Keep `path` (None, a split that does not fit: nothing)."""
        if path is None or path in self.seen:
            return
        self.seen.add(path)
        self.revision += 1
        if len(self.found) < MOST_PATHS:
            self.found.append(path)
            self.versions.append(0)
            self.used = np.append(self.used, 0.0)
            return
        place = int(self.used.argmin())
        self.seen.discard(self.found[place])
        self.found[place] = path
        self.versions[place] += 1
        self.used /= 2
        self.used[place] = self.used.mean()


def path_key(candidate: Candidate) -> tuple:
    """What a candidate's critical paths depend on: its schedule's order and whether sends are buffered."""
    return candidate.schedule, candidate.layout.pp, candidate.microbatches, candidate.chunks, candidate.buffered


def critical_path(candidate: Candidate, counts: tuple[int, ...]) -> CriticalPath | None:
    """The critical path of layers per virtual stage `counts`, ranks on cores of their own (None: they do not fit the
    candidate's memory)."""
    seconds = candidate.replay_seconds(counts)
    return None if seconds is None else candidate.replay.critical_path(*seconds)


class PathTables:
    """One candidate's bounds from `paths`: per path and virtual stage v, the least length over virtual stages
    v, v + 1, ... of any ranges of layers [start, L) (`least[v, path, start]`), each range at its stage's
    cheapest checkpointing level that fits (later chunks can only raise it). A path's tail counts as the pipeline's
    closing collective plus the shares of its stage's chunks (`Candidate.tail_share_s`), at most the tail."""

    @classmethod
    def of(cls, candidate: Candidate, paths: CriticalPaths) -> PathTables:
        """The tables of `paths` for the candidate's ranges, kept in its `RangeCosts` for later searches of a
        candidate with the same ranges (another memory ceiling: the tables do not depend on it)."""
        key = (tuple(candidate.range_kind(v) for v in range(candidate.virtual)), path_key(candidate))
        kept = candidate.range_costs.terms
        if key not in kept or kept[key].paths is not paths:
            kept[key] = cls(candidate, paths)
        return kept[key]

    def __init__(self, candidate: Candidate, paths: CriticalPaths):
        self.candidate, self.paths, self.versions, self.revision = candidate, paths, [], -1
        c, virtual, layers = candidate, candidate.virtual, candidate.num_layers
        self.terms = np.zeros((virtual, layers + 1, layers + 1, TERMS))
        self.invalid = np.full((virtual, layers + 1, layers + 1), np.inf)
        for v in range(virtual):
            later = virtual - 1 - v
            terms, invalid = _range_terms(c, v)
            window = (slice(v, layers - later), slice(v + 1 if later else layers, layers - later + 1))
            self.terms[v][window], self.invalid[v][window] = terms[window], invalid[window]
        # per virtual stage and path (the paths one row each, so the lengths of many ways reduce over the paths row
        # by row): the path's coefficients per term, and its least length from virtual stage v and layer start on
        self.coef = np.zeros((virtual, 0, TERMS))
        self.least = np.zeros((virtual + 1, 0, layers + 1))
        self.kills = np.zeros(0, dtype=int)  # per path: the ways the screen let by that it cut (`completions`)
        self.placed: list[tuple[int, int]] = []  # the ranges `prefix` holds: prefix[d], the paths' lengths over d
        self.prefix: list[np.ndarray] = []
        self.sync()

    def sync(self) -> None:
        """Take in the paths found, or put in a place, since the last call."""
        if self.revision == self.paths.revision:
            return
        self.revision = self.paths.revision
        found, versions = self.paths.found, self.paths.versions
        changed = [i for i in range(len(self.versions)) if self.versions[i] != versions[i]]
        changed += range(len(self.versions), len(found))
        if not changed:  # the pool is empty yet
            return
        stages = [stage for stage, _ in self.candidate.located]
        virtual, size = self.terms.shape[0], self.terms.shape[1]
        coef = np.array(
            [
                [p.forward, p.gradient, p.weight, p.send, p.late, [float(s == p.stage) for s in stages]]
                for p in (found[i] for i in changed)
            ],
            dtype=float,
        ).transpose(2, 0, 1)  # (virtual, paths, terms)
        least = np.full((len(changed), virtual + 1, size), np.inf)
        least[:, virtual, size - 1] = 0.0
        lengths = np.einsum("vabj,vpj->pvab", self.terms, coef) + self.invalid
        for v in range(virtual - 1, -1, -1):
            least[:, v] = (lengths[:, v] + least[:, v + 1, None, :]).min(axis=2)
        grown = len(found) - len(self.versions)
        if grown:
            self.coef = np.concatenate([self.coef, np.zeros((virtual, grown, TERMS))], axis=1)
            self.least = np.concatenate([self.least, np.zeros((virtual + 1, grown, size))], axis=1)
        self.kills = np.append(self.kills, np.zeros(grown, dtype=int))
        self.coef[:, changed], self.least[:, changed], self.kills[changed] = coef, least.transpose(1, 0, 2), 0
        self.versions = list(versions)
        self.placed, self.prefix = [], [np.full(len(found), self.candidate.closing_s)]

    def children_s(self, ranges: list[tuple[int, int]], v: int, start: int, stops: list[int]) -> np.ndarray | None:
        """Per stop: a bound on every split that gives the virtual stages before v `ranges` and virtual stage v
        layers [start, stop) (None: no paths yet)."""
        self.sync()
        if not self.versions:
            return None
        lengths = self.coef[v] @ self.terms[v, start, stops].T  # (paths, stops)
        bounds = self._placed_s(ranges, v)[:, None] + lengths + self.least[v + 1][:, stops]
        if len(self.versions) >= MOST_PATHS:  # which paths bound, for the pool to keep them
            self.paths.used += np.bincount(bounds.argmax(axis=0), minlength=len(self.versions))
        return bounds.max(axis=0)

    def completions(
        self,
        ranges: list[tuple[int, int]],
        v: int,
        start: int,
        bar: float,
        budget: int,
        firsts: Sequence[int] | None = None,
        invalid: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """The stops of virtual stages v, v + 1, ... (one row per way to split layers [start, L) among them) of the
        splits that give the virtual stages before v `ranges` and that no path takes to `bar`, best first (None: no
        paths yet, or the ways of some first virtual stages times the paths over `budget`); `firsts`: the only stops
        virtual stage v may take (None: any); `invalid`: inf at the ranges no way may take, 0 elsewhere (None: the
        tables' own, those over the memory limit).

        Every such way is enumerated, the paths' lengths summed along it: the max over paths of a whole split's lengths
        couples them, which `children_s` (each path's least over the layers left on its own) does not."""
        self.sync()
        if not self.versions:
            return None
        virtual, layers = self.terms.shape[0], self.terms.shape[1] - 1
        lengths = self._placed_s(ranges, v)[:, None]  # (paths, ways)
        starts = np.array([start])
        parents, chosen = [], []  # per level: each way's way at the level before, and its stop
        threshold = bar / (1 - ROUNDING)
        invalid = (self.invalid if invalid is None else invalid).reshape(virtual, -1)
        terms = self.terms.reshape(virtual, -1, TERMS)
        screen = self.kills.argsort(kind="stable")[-SCREEN:] if len(self.versions) > SCREEN else None
        for u in range(v, virtual):
            if u == v and firsts is not None:
                ends = np.array(firsts)
                ways = np.zeros_like(ends)
            elif u == virtual - 1:  # the last virtual stage takes the layers left
                ways, ends = np.arange(len(starts)), np.full_like(starts, layers)
            else:  # each way so far may stop virtual stage u anywhere after its start, leaving a layer to each after
                counts = layers - (virtual - 1 - u) - starts
                ways = np.repeat(np.arange(len(starts)), counts)
                ends = np.arange(len(ways)) - np.repeat(np.cumsum(counts) - counts - starts - 1, counts)
            if len(ways) * len(self.versions) > budget:
                return None
            ranges_at = starts.take(ways) * (layers + 1) + ends  # [start, end) as a flat index into u's tables
            fits = (invalid[u].take(ranges_at) == 0).nonzero()[0]  # ranges that fit a memory level
            ways, ends, seconds = ways.take(fits), ends.take(fits), terms[u].take(ranges_at.take(fits), axis=0).T
            if screen is not None:  # the screen first; all paths check the ways it leaves
                reach = lengths[screen].take(ways, axis=1)
                reach += self.coef[u][screen] @ seconds
                reach += self.least[u + 1][screen].take(ends, axis=1)
                kept = (reach.max(axis=0) < threshold).nonzero()[0]
                ways, ends, seconds = ways.take(kept), ends.take(kept), seconds.take(kept, axis=1)
            grown = lengths.take(ways, axis=1)
            grown += self.coef[u] @ seconds
            reach = self.least[u + 1].take(ends, axis=1)
            reach += grown
            cut = reach.max(axis=0) >= threshold
            np.add.at(self.kills, reach[:, cut].argmax(axis=0), 1)
            alive = (~cut).nonzero()[0]
            if not len(alive):  # no way left
                return np.zeros((0, virtual - v), dtype=int)
            lengths, starts = grown.take(alive, axis=1), ends.take(alive)
            parents.append(ways.take(alive))
            chosen.append(starts)
        order = lengths.max(axis=0).argsort(kind="stable")
        stops = np.empty((len(order), virtual - v), dtype=int)
        for level in range(virtual - v - 1, -1, -1):  # back from the last virtual stage's stops to v's
            stops[:, level] = chosen[level][order]
            order = parents[level][order]
        return stops

    def _placed_s(self, ranges: list[tuple[int, int]], v: int) -> np.ndarray:
        """Per path, its length over the virtual stages before v holding `ranges` (kept from the last call's as far
        as they share ranges)."""
        coef, terms, placed, prefix = self.coef, self.terms, self.placed, self.prefix
        kept = 0
        while kept < min(v, len(placed)) and placed[kept] == ranges[kept]:
            kept += 1
        del placed[kept:], prefix[kept + 1 :]
        for u in range(kept, v):
            placed.append(ranges[u])
            prefix.append(prefix[u] + coef[u] @ terms[u, ranges[u][0], ranges[u][1]])
        return prefix[v]


def _range_terms(candidate: Candidate, v: int) -> tuple[np.ndarray, np.ndarray]:
    """`TERMS` seconds of every layer range on virtual stage v, and inf where the range alone fits no memory level
    (kept in the candidate's `RangeCosts` per `Candidate.range_kind`, which candidates of one cost model share)."""
    c, layers = candidate, candidate.num_layers
    kind, kept = c.range_kind(v), c.range_costs.terms
    if kind not in kept:
        stage = c.located[v][0]
        terms = np.zeros((layers + 1, layers + 1, TERMS))
        invalid = np.full((layers + 1, layers + 1), np.inf)
        for start in range(layers):
            for stop in range(start + 1, layers + 1):
                costs = c.least_range_cost(v, start, stop)
                if costs is None:
                    break  # and more so with more layers
                forward, gradient, send, _, weight = costs
                late, share = send - c.early_s(v, stop), c.tail_share_s(stage, start, stop)
                terms[start, stop] = (forward, gradient, weight, send, late, share)
                invalid[start, stop] = 0.0
        kept[kind] = (terms, invalid)
    return kept[kind]
