"""Lower bounds on the simulated step, for pruning the partition search (never above what `Replay` predicts).

The simulated step is the longest path through the step's actions: each action after the previous one on its stage
and after the action it waits for (plus the transfer between them). Any path is a lower bound. The paths used here:

- Along one stage: the time the first micro-batch needs to reach it (`head`), every action of the stage in order,
  then its tail (`drain`: its exposed DP sync and optimizer step, or the last gradient's way down to an earlier stage
  and that stage's tail). On the way the path may leave the stage at a forward of its last chunk, climb through
  every later virtual stage and come back down to a backward (`excursion`), and move between its own chunks through
  the virtual stages between them (`up`, `down`). These are the paths that make 1F1B's round trips and GPipe's
  forward and backward phases count.
- On NCCL, what a stage of GPipe or 1F1B idles for between its actions (`OneChunkWalk.gaps`): the sends it waits
  for, and each transfer into it, which starts only once the stage posts its recv after the action before.
- For stages not assigned yet, minimum-over-splits tables (`SuffixBounds`) of the same paths.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache

from holmes_lightning.planner.options import Schedule
from holmes_lightning.planner.plan_types import locate_virtual
from holmes_lightning.planner.schedules import WEIGHT, Action
from holmes_lightning.planner.simulate import Replay

UP, DOWN = 1, 2  # `OneChunkWalk.gaps`: a transfer to the next virtual stage (a forward's), or to the previous
ROUNDING = 1e-12  # relative slack for bounds summed in another order than the simulator sums the same seconds

# (virtual stage, first layer, stop layer) -> (forward s, backward s, send s, tail s, weight s), or None if it cannot
# fit; the backward is what the previous virtual stage waits for, the weight passes (zero-bubble schedules) the rest
RangeCost = Callable[[int, int, int], "tuple[float, float, float, float, float] | None"]


def latest_turns(top_order: Sequence[Action], chunk: int, microbatches: int) -> list[int]:
    """Per micro-batch j': the last micro-batch j whose forward the top stage runs before j''s backward (-1: none).

    A path may climb with micro-batch j and come down with j' only if the top stage runs forward j before backward j'.
    """
    forwards, latest = 0, [-1] * microbatches
    for action in top_order:
        if action.chunk != chunk or action.part == WEIGHT:
            continue
        if action.backward:
            latest[action.microbatch] = forwards - 1
        else:
            forwards += 1
    return latest


@dataclass(frozen=True)
class GapCounts:
    """`OneChunkWalk.gaps` counted, in a form quick to time: how many actions idle for a transfer up, for one down,
    for the longer of the two (`either`), and the rest (with an overlapped send) one by one."""

    up: int
    down: int
    either: int
    overlapping: tuple[tuple[tuple[int, int, int], bool, int], ...]

    @classmethod
    def of(cls, gaps: Sequence[tuple[tuple[int, int, int], bool]]) -> GapCounts:
        counts = Counter(gaps)
        simple = Counter()
        for ((waited, received, overlapped), _), count in counts.items():
            if not overlapped:
                simple[frozenset({waited, received} - {0})] += count
        overlapping = tuple((gap, backward, count) for (gap, backward), count in counts.items() if gap[2])
        return cls(simple[frozenset({UP})], simple[frozenset({DOWN})], simple[frozenset({UP, DOWN})], overlapping)

    def seconds(self, forward: float, backward: float, up: float, down: float) -> float:
        total = self.up * up + self.down * down + self.either * max(up, down)
        transfer_s = (0.0, up, down)
        for (waited, received, overlapped), own_backward, count in self.overlapping:
            gap = max(transfer_s[waited], transfer_s[received])
            total += count * (gap + max(transfer_s[overlapped] - gap - (backward if own_backward else forward), 0.0))
        return total


@dataclass(frozen=True)
class OneChunkWalk:
    """A one-chunk stage's actions, for the longest path through them with excursions (`one_chunk_path_s`).

    `steps`: per action -3 a weight pass, -2 a forward, -1 a backward no excursion reaches, else the index (among
    the stage's forwards) of the forward an excursion to this backward leaves from, the latest the top stage allows.
    Per backward, for `path_s`: its step, the forwards, backwards and weight passes an excursion to it skips, and the
    last backward whose excursion ends before this one leaves (-1: none). `form`: "1F1B" (excursion j skips
    min(w-1, m-1-j) forwards and min(j, w-1) backwards and may follow excursion j - w; w = `warmup`), "first" (one
    excursion at most, the first backward's the best, as GPipe), else "any": `path_s` then has a closed form, or one
    pass over the backwards. `weights`: how many weight passes (a zero-bubble schedule's) the walk holds.

    `gaps`: per action, the transfers the stage idles for around it (`UP`, `DOWN` or 0: none), as torch's GPipe and
    1F1B post and wait on NCCL: (the previous action's send, waited for before it starts; the transfer into it,
    which starts only once the stage posts its recv after the previous action; the previous action's send, waited for
    before the stage moves on after it). Empty where sends are done before their data arrives (buffered backends).
    `gap_counts`: how many actions have each gaps, by their kind (forward or backward); `closing`: how many
    backwards (input passes) follow its last forward, and `closing_gaps` their gap counts.
    """

    steps: tuple[int, ...]
    turns: tuple[int, ...]
    skipped_forwards: tuple[int, ...]
    skipped_backwards: tuple[int, ...]
    previous: tuple[int, ...]
    form: str = "any"
    warmup: int = 0
    skipped_weights: tuple[int, ...] = ()
    weights: int = 0
    gaps: tuple[tuple[int, int, int], ...] = ()
    gap_counts: GapCounts = field(default_factory=lambda: GapCounts.of([]))
    closing: int = 0
    closing_gaps: GapCounts = field(default_factory=lambda: GapCounts.of([]))

    @classmethod
    def of(
        cls, order: Sequence[Action], top_turns: Sequence[int], gaps: Sequence[tuple[int, int, int]] = ()
    ) -> OneChunkWalk:
        steps, forward_at, backward_at, weight_at = [], [], [], []
        for position, action in enumerate(order):
            if action.part == WEIGHT:
                steps.append(-3)
                weight_at.append(position)
            elif action.backward:
                steps.append(min(top_turns[action.microbatch], len(forward_at) - 1))
                backward_at.append(position)
            else:
                steps.append(-2)
                forward_at.append(position)
        turns = tuple(steps[position] for position in backward_at)
        skipped_forwards, skipped_backwards, skipped_weights, previous = [], [], [], []
        for b, position in enumerate(backward_at):
            leaves = forward_at[turns[b]] if turns[b] >= 0 else position
            skipped_forwards.append(bisect_left(forward_at, position) - bisect_right(forward_at, leaves))
            skipped_backwards.append(b - bisect_right(backward_at, leaves))
            skipped_weights.append(bisect_left(weight_at, position) - bisect_right(weight_at, leaves))
            previous.append(bisect_left(backward_at, leaves) - 1)
        m, w = len(backward_at), bisect_left(forward_at, backward_at[0]) if backward_at else 0
        form = "any"  # also with weight passes: the closed forms count forwards and backwards only
        if not weight_at and all(
            (turns[j], skipped_forwards[j], skipped_backwards[j], previous[j])
            == (j, min(w - 1, m - 1 - j), min(j, w - 1), max(j - w, -1))
            for j in range(m)
        ):
            form = "1F1B"
        elif (
            not weight_at
            and m
            and all(
                previous[j] == -1
                and turns[j] >= 0
                and skipped_forwards[j] >= skipped_forwards[0]
                and skipped_backwards[j] >= skipped_backwards[0]
                for j in range(m)
            )
        ):
            form = "first"
        skipped = tuple(skipped_forwards), tuple(skipped_backwards)
        last_forward = forward_at[-1] if forward_at else -1

        def counted(first: int) -> GapCounts:
            return GapCounts.of([(gaps[p], order[p].backward) for p in range(first, len(gaps)) if any(gaps[p])])

        return cls(
            tuple(steps),
            turns,
            *skipped,
            tuple(previous),
            form,
            w,
            tuple(skipped_weights),
            len(weight_at),
            tuple(gaps),
            counted(0),
            len(backward_at) - bisect_right(backward_at, last_forward),
            counted(last_forward + 1),
        )

    def waits_s(self, forward: float, backward: float, up: float, down: float, closing: bool = False) -> float:
        """At least how long the stage idles on transfers between its actions (`gaps`; `up`: a transfer to the next
        virtual stage, `down`: to the previous); `closing`: only around the backwards after its last forward."""
        if not self.gaps:
            return 0.0
        return (self.closing_gaps if closing else self.gap_counts).seconds(forward, backward, up, down)

    def path_s(
        self,
        forward: float,
        backward: float,
        excursion: float | None,
        weight: float = 0.0,
        up: float = 0.0,
        down: float = 0.0,
    ) -> float:
        """`one_chunk_path_s` without descents: every action, plus the excursions with the largest total gain (each
        replaces the actions it skips by `excursion`; each leaves after the one before came back)."""
        if self.gaps and (up or down):  # the waits on transfers: one pass over the actions
            return one_chunk_path_s(self, forward, backward, excursion, (), weight, up, down)
        backwards, weights = len(self.turns), self.weights
        total = (len(self.steps) - backwards - weights) * forward + backwards * backward + weights * weight
        if excursion is None:
            return total
        if self.form == "first":
            first = excursion - self.skipped_forwards[0] * forward - self.skipped_backwards[0] * backward
            return total + max(first, 0.0)
        if self.form == "1F1B":  # gains fall, stay flat, rise: the first and last backwards, every w-th between
            w = self.warmup
            first, last = excursion - (w - 1) * forward, excursion - (w - 1) * backward
            steady = excursion - (w - 1) * (forward + backward)
            count = (backwards - 1) // w + 1  # excursions that fit
            if count == 1:
                return total + max(first, last, 0.0)
            if steady > 0:
                return total + first + last + (count - 2) * steady
            return total + max(first, 0.0) + max(last, 0.0)
        best_by: list[float] = []  # the largest total gain of excursions that come back at or before each backward
        best = 0.0
        for b in range(backwards):
            gain = excursion - self.skipped_forwards[b] * forward - self.skipped_backwards[b] * backward
            if weights:
                gain -= self.skipped_weights[b] * weight
            if self.turns[b] >= 0 and gain > 0:
                before = self.previous[b]
                gain += best_by[before] if before >= 0 else 0.0
                best = max(best, gain)
            best_by.append(best)
        return total + best


@dataclass(frozen=True)
class PathShapes:
    """What the path bounds need of one schedule's orders (`pp` stages, `microbatches`, `chunks` per stage).

    A zero-bubble schedule's backwards count as their input passes (what the stage below waits for); its weight
    passes wait for nothing but their stage. `orders`: each stage's actions up to its last input pass (`stage_path_s`
    walks them), `trailing`: the chunks of the weight passes after it (they delay the stage's tail, not the gradient
    going down). Per virtual stage, its chunk's actions in its stage's order up to its last input pass (the other
    chunks' left out): `walks` (their `OneChunkWalk`) and `descents` (their `descent_turns`); `turns`:
    `latest_turns` of the last virtual stage. `gated`: the walks hold the waits on transfers (`OneChunkWalk.gaps`).
    """

    orders: tuple[tuple[Action, ...], ...]
    trailing: tuple[tuple[int, ...], ...]
    turns: tuple[int, ...]
    walks: tuple[OneChunkWalk, ...]
    descents: tuple[tuple[int, ...], ...]

    @classmethod
    @cache
    def of(cls, schedule: Schedule, pp: int, microbatches: int, chunks: int, gated: bool = False) -> PathShapes:
        replay = Replay.of(schedule, pp, microbatches, chunks)
        orders, trailing = [], []
        for order in replay.orders:
            end = _through_last_pass(order)
            orders.append(tuple(order[:end]))
            trailing.append(tuple(action.chunk for action in order[end:]))
        chunk_orders = []  # each up to its last input pass: the weight passes after it delay no gradient
        for virtual in range(pp * chunks):
            stage, chunk = locate_virtual(virtual, pp, v_shaped=Schedule(schedule).v_shaped)
            own = [action for action in orders[stage] if action.chunk == chunk]
            chunk_orders.append(own[: _through_last_pass(own)])
        turns = tuple(latest_turns(chunk_orders[-1], chunks - 1, microbatches))
        return cls(
            tuple(orders),
            tuple(trailing),
            turns,
            tuple(
                OneChunkWalk.of(order, turns, _gaps(replay, v)[: len(order)] if gated and chunks == 1 else ())
                for v, order in enumerate(chunk_orders)
            ),
            tuple(tuple(descent_turns(order, microbatches)) for order in chunk_orders),
        )


def _gaps(replay: Replay, stage: int) -> list[tuple[int, int, int]]:
    """Per action of a one-chunk stage, in its order, its `OneChunkWalk.gaps`."""
    indices = [i for i, (s, _) in enumerate(replay.actions) if s == stage]  # listed in the stage's order
    gaps = []
    for p, i in enumerate(indices):
        previous = indices[p - 1] if p else -2
        sent = (DOWN if replay.backward[previous] else UP) if p else 0
        received = 0  # the first action's transfer is in the path's head
        if p and replay.rendezvous and replay.transfer[i] >= 0:
            received = UP if replay.backward[i] else DOWN
        waited = sent if replay.gate[i] == previous else 0
        gaps.append((waited, received, sent if replay.after_gate[i] == previous else 0))
    return gaps


def _through_last_pass(order: Sequence[Action]) -> int:
    """How many of `order`'s actions run up to its last forward or backward (the weight passes after it excluded)."""
    return max((p + 1 for p, action in enumerate(order) if action.part != WEIGHT), default=0)


def descent_turns(order: Sequence[Action], microbatches: int) -> list[int]:
    """Per micro-batch i: the last micro-batch j whose backward a one-chunk stage runs before its forward i (-1: none).

    A path that came down to this stage with j's gradient may climb back with micro-batch i (1F1B's steady state).
    """
    backwards, latest = 0, [-1] * microbatches
    for action in order:
        if action.part == WEIGHT:
            continue
        if action.backward:
            backwards += 1
        else:
            latest[action.microbatch] = backwards - 1
    return latest


def one_chunk_path_s(
    walk: OneChunkWalk,
    forward: float,
    backward: float,
    excursion: float | None,
    descents: Sequence[tuple[Sequence[int], float]] = (),
    weight: float = 0.0,
    up: float = 0.0,
    down: float = 0.0,
) -> float:
    """`stage_path_s` of a stage with one chunk, from its first action's start to its last action's end (`weight`:
    each weight pass's seconds; `up`, `down`: a transfer to the next and to the previous virtual stage, for the
    walk's `gaps`).

    `descents`: (that stage's `descent_turns`, seconds) per earlier stage: a path may leave this stage at a backward,
    go down to that stage with the gradient, and climb back with a later micro-batch (a cycle across slow links or
    slow stages below, seconds: every action and both transfers between the two stages, that stage's included).
    """
    gaps = walk.gaps if up or down else ()
    if not descents and not gaps:
        return walk.path_s(forward, backward, excursion, weight)
    transfer_s = (0.0, up, down)
    clock = 0.0
    forward_end: list[float] = []
    backward_end: list[float] = []
    forwards = backwards = 0  # the lists' lengths (this loop runs for most partial splits the search visits)
    climbs = excursion is not None
    overlapped = 0.0
    for position, step in enumerate(walk.steps):
        previous_end = clock
        if gaps:
            waited, received, after = gaps[position]
            clock += max(transfer_s[waited], transfer_s[received])
            overlapped = transfer_s[after]
        if step == -2:
            for turns, seconds in descents:
                j = turns[forwards]
                if j >= backwards:
                    j = backwards - 1
                if j >= 0:
                    back = backward_end[j] + seconds
                    if back > clock:
                        clock = back
            clock += forward
            forward_end.append(clock)
            forwards += 1
        elif step == -3:
            clock += weight
        else:
            if climbs and step >= 0:
                back = forward_end[step] + excursion
                if back > clock:
                    clock = back
            clock += backward
            backward_end.append(clock)
            backwards += 1
        if previous_end + overlapped > clock:
            clock = previous_end + overlapped
    return clock


def stage_path_s(
    *,
    order: Sequence[Action],
    forward: Sequence[float],
    backward: Sequence[float],
    excursion: float | None,
    turns: Sequence[int],
    up: Sequence[float],
    down: Sequence[float],
    weight: Sequence[float] = (),
) -> float:
    """Longest path through one stage's actions (per chunk seconds), from its first action's start to its last's end
    (`PathShapes.orders`: a zero-bubble schedule's up to its last input pass).

    It may leave at a forward of the top chunk and come back at a backward `excursion` later (None: the stage runs
    the last virtual stage), and hop from chunk j to j + 1 (`up[j]`) or back (`down[j]`) through the stages between.
    A zero-bubble schedule's weight passes in `order` take `weight[j]` each and wait for nothing but the stage.
    """
    chunks = len(forward)
    top = chunks - 1
    forward_end = [[-math.inf] * len(turns) for _ in range(chunks)]
    backward_end = [[-math.inf] * len(turns) for _ in range(chunks)]
    done = [0] * chunks
    clock = 0.0
    for action in order:
        j, mb = action.chunk, action.microbatch
        if action.part == WEIGHT:
            clock += weight[j]
            continue
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
    return clock


def water_level_s(bases: Sequence[float], rates: Sequence[float], work: float) -> float:
    """The least possible max over stages of base + rate x share when `work` is shared out freely (shares >= 0).

    A lower bound for the stages that still get layers: ignoring that layers come whole and in order can only help.
    """
    if work <= 0 or not bases:
        return max(bases, default=0.0)
    level, weights, spread = math.inf, 0.0, 0.0  # level = (work + sum base / rate) / sum 1 / rate over the lowest
    ranked = sorted(zip(bases, rates, strict=True))
    for i, (base, rate) in enumerate(ranked):
        weights += 1 / rate
        spread += base / rate
        level = (work + spread) / weights
        if i + 1 == len(ranked) or level <= ranked[i + 1][0]:
            break
    return max(level, ranked[-1][0])  # a stage already above the level gets no share and keeps its base


@dataclass
class SuffixBounds:
    """For every virtual stage u and first layer x: bounds over every split of layers [x, L) into stages u, u+1, ...

    `chain[u][x]`: the least sum of (forward + backward + 2 x send) over the stages, what one micro-batch's round trip
    through them takes at least. `reach[u][x]`: the least, over splits, of the largest (forwards and sends before
    stage t) + stage t's path + its tail (0 with several chunks per stage: it depends on them all): its path measured
    from stage u's first forward. `relay[u][x]`: the same with the way back (backwards and sends below t) instead of
    the tail. A virtual stage's path is `one_chunk_path_s` of its chunk's actions with the least round trip above it
    (`paths[(u, x, y)]`; `climbs`: the same paths as the split search takes them, from the range's costs and sends,
    kept for it where they follow from the range alone). math.inf: no split fits.

    Splits only count if they could make a step below `bar`: a stage whose path and tail alone reach it cannot be in
    one, so the round trip cannot dodge the bottleneck by putting every layer on the fastest stage.
    """

    chain: list[list[float]]
    reach: list[list[float]]
    relay: list[list[float]]
    paths: dict[tuple[int, int, int], float] = field(default_factory=dict)
    climbs: dict[tuple[int, int, int], float] = field(default_factory=dict)
    bar: float = math.inf

    @classmethod
    def build(
        cls,
        cost: RangeCost,
        *,
        virtual: int,
        layers: int,
        microbatches: int,
        walks: Sequence[OneChunkWalk],
        bar: float = math.inf,
    ) -> SuffixBounds:
        """`walks`: per virtual stage the `OneChunkWalk` of its chunk's actions."""
        inf, m, keep = math.inf, microbatches, bar / (1 - ROUNDING)
        tables = cls(
            chain=[[inf] * (layers + 1) for _ in range(virtual + 1)],
            reach=[[inf] * (layers + 1) for _ in range(virtual + 1)],
            relay=[[inf] * (layers + 1) for _ in range(virtual + 1)],
            bar=bar,
        )
        for u in range(virtual - 1, -1, -1):
            later = virtual - 1 - u
            chain_above, reach_above = tables.chain[u + 1], tables.reach[u + 1]
            relay_above = tables.relay[u + 1]
            walk = walks[u]  # its path is at least its passes (the weight passes up to its last input pass)
            for x in range(u, layers - later):
                stops = range(layers, layers + 1) if later == 0 else range(x + 1, layers - later + 1)
                best_chain = inf
                reach, relay = [], []  # per stop: (value's floor, stop, forward, backward, weight, send, climb, tail,
                # past, the stage's floor)
                for y in stops:
                    costs = cost(u, x, y)
                    if costs is None:
                        continue
                    forward, backward, send, tail, weight = costs
                    work = forward + backward
                    floor = m * work + walk.weights * weight + walk.waits_s(forward, backward, send, 0.0)
                    if floor + tail >= keep:
                        continue
                    if later == 0:
                        best_chain = min(best_chain, work)
                        reach.append((floor + tail, y, forward, backward, weight, send, None, tail, 0.0, floor))
                        relay.append((floor, y, forward, backward, weight, send, None, 0.0, 0.0, floor))
                        continue
                    climb = 2 * send + chain_above[y]
                    best_chain = min(best_chain, work + climb)
                    past = forward + send + reach_above[y]
                    least = max(floor + tail, past)
                    reach.append((least, y, forward, backward, weight, send, climb, tail, past, floor))
                    past = work + 2 * send + relay_above[y]
                    relay.append((max(floor, past), y, forward, backward, weight, send, climb, 0.0, past, floor))
                tables.chain[u][x] = best_chain
                tables.reach[u][x] = tables._least(reach, walk, u, x)
                tables.relay[u][x] = tables._least(relay, walk, u, x)
        return tables

    @property
    def root_s(self) -> float:
        """A lower bound on the step of any split of the whole model that could get below `bar` (math.inf: none)."""
        return max(self.reach[0][0], self.relay[0][0])

    def _least(self, options: list[tuple], walk: OneChunkWalk, u: int, x: int) -> float:
        """min over a stage's ranges of max(its path + tail, what lies past it), `options` as `build` lists them.

        The path (at least its floor, m x work) is computed only for ranges whose floor could still give the least.
        """
        best = math.inf
        for least, y, forward, backward, weight, send, climb, tail, past, floor in sorted(options):
            if least >= best:
                break
            key = (u, x, y)
            if key not in self.paths:  # past the first stage, the waits on transfers only in its floor: closed forms
                path = walk.path_s(forward, backward, climb, weight, send if u == 0 else 0.0)
                self.paths[key] = max(path, floor)
            best = min(best, max(self.paths[key] + tail, past))
        return best
