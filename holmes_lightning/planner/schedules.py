"""Per-stage action orders of the pipeline schedules, as torch.distributed.pipelining runs them (no processes here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from holmes_lightning.planner.options import MODELLED_SCHEDULES, Schedule

FULL, INPUT, WEIGHT = "full", "input", "weight"  # what part of its pass an action runs


@dataclass(frozen=True)
class Action:
    """One forward or backward of one micro-batch through one of a stage's chunks.

    `part`: a backward may run as two actions (`Schedule.splits_backward`): INPUT, the input gradient, which the
    previous stage waits for, then WEIGHT, the weight gradient, which nothing waits for; else FULL, both at once.
    """

    backward: bool
    chunk: int
    microbatch: int
    part: str = FULL

    @property
    def sends(self) -> bool:
        """Whether its result goes to a neighbour (a weight pass keeps its gradient)."""
        return self.part != WEIGHT

    @property
    def frees(self) -> bool:
        """Whether the micro-batch's stash is released after it (a backward's input pass leaves what the weight pass
        needs)."""
        return self.backward and self.part != INPUT


def microbatch_problem(schedule: Schedule, pp: int, microbatches: int) -> str | None:
    """Why torch's schedule would refuse this micro-batch count for `pp` stages, or None."""
    schedule = Schedule(schedule)
    if schedule == Schedule["1F1B"] and microbatches < pp:
        return f"schedule 1F1B needs microbatches >= stages, got {microbatches} < {pp}"
    if schedule == Schedule.DualPipeV and microbatches < 2 * pp:
        return f"schedule DualPipeV needs microbatches >= virtual stages (2 x pp), got {microbatches} < {2 * pp}"
    rounds = max(1, microbatches // pp)
    if schedule.interleaved and microbatches % rounds:
        return (
            f"schedule {schedule.value} needs microbatches to be a multiple of max(1, microbatches // pp) = {rounds}, "
            f"got {microbatches} with pp={pp}"
        )
    return None


def stage_actions(schedule: Schedule, stage: int, pp: int, microbatches: int, chunks: int = 1) -> list[Action]:
    """The order in which `stage` of `pp` runs its forwards and backwards (`chunks` > 1: interleaved)."""
    schedule = Schedule(schedule)
    if schedule == Schedule.GPipe:
        forwards = [Action(False, 0, mb) for mb in range(microbatches)]
        return forwards + [Action(True, 0, mb) for mb in range(microbatches)]
    if schedule == Schedule["1F1B"]:
        return _one_f_one_b(stage, pp, microbatches)
    if schedule.interleaved:
        return _interleaved(stage, pp, microbatches, chunks, zero_bubble=schedule.splits_backward)
    if schedule == Schedule.ZBVZeroBubble:
        return _zero_bubble_v(stage, pp, microbatches)
    if schedule == Schedule.DualPipeV:
        return _dual_pipe_v(stage, pp, microbatches)
    raise ValueError(f"schedule={schedule.value} is no order to run; use one of {', '.join(MODELLED_SCHEDULES)}")


def _one_f_one_b(stage: int, pp: int, microbatches: int) -> list[Action]:
    """torch's Schedule1F1B: `pp - stage` warm-up forwards, then backward/forward pairs, then the last backwards."""
    warmup = min(microbatches, pp - stage)
    actions = [Action(False, 0, mb) for mb in range(warmup)]
    for backward_mb in range(microbatches):
        actions.append(Action(True, 0, backward_mb))
        if warmup + backward_mb < microbatches:
            actions.append(Action(False, 0, warmup + backward_mb))
    return actions


def _interleaved(stage: int, pp: int, microbatches: int, chunks: int, *, zero_bubble: bool = False) -> list[Action]:
    """torch's ScheduleInterleaved1F1B: micro-batches in rounds of `per_round`, chunks visited round by round.

    `zero_bubble`: ScheduleInterleavedZeroBubble (ZB1P): warm-up one forward per hop instead of two, each backward
    split into its input pass and a weight pass that follows `stage` input passes later.
    """
    per_round = microbatches // max(1, microbatches // pp)
    total = microbatches * chunks
    hops = pp - 1 - stage
    warmup = min((chunks - 1) * per_round + (hops if zero_bubble else 2 * hops), total)
    counts: dict[tuple[bool, str], list[int]] = {}
    weights_due: list[int] = []  # chunks of the input passes whose weight pass is still to come

    def action(backward: bool, chunk: int, part: str = FULL) -> Action:
        next_mb = counts.setdefault((backward, part), [0] * chunks)
        next_mb[chunk] += 1
        return Action(backward, chunk, next_mb[chunk] - 1, part)

    def forward(step: int) -> list[Action]:
        return [action(False, (step // per_round) % chunks)]

    def backward(step: int) -> list[Action]:
        chunk = chunks - 1 - (step // per_round) % chunks
        if not zero_bubble:
            return [action(True, chunk)]
        weights_due.append(chunk)
        done = [action(True, chunk, INPUT)]
        if step >= stage:
            done.append(action(True, weights_due.pop(0), WEIGHT))
        return done

    actions = [a for step in range(warmup) for a in forward(step)]
    for step in range(warmup, total):
        actions += forward(step) + backward(step - warmup)
    for step in range(total - warmup, total):
        actions += backward(step)
    return actions + [action(True, chunk, WEIGHT) for chunk in weights_due]


class _Counter:
    """Hands out each (chunk, pass) its next micro-batch, in order."""

    def __init__(self) -> None:
        self.next: dict[tuple[int, str], int] = {}

    def take(self, chunk: int, kind: str) -> int:
        microbatch = self.next.get((chunk, kind), 0)
        self.next[(chunk, kind)] = microbatch + 1
        return microbatch

    def forward(self, chunk: int) -> Action:
        """The chunk's next forward."""
        return Action(False, chunk, self.take(chunk, "forward"))


def _zero_bubble_v(stage: int, pp: int, microbatches: int) -> list[Action]:
    """torch's ScheduleZBVZeroBubble on V placement (chunk 0 is virtual stage `stage`, chunk 1 is 2 pp - 1 - stage).

    Planned for at least 2 pp - 1 micro-batches (torch drops the actions of those it does not have): warm-up
    forwards of chunk 0, then of both chunks, then chunk 1's forward, input and weight passes, a steady state of both
    chunks' forward, input and weight passes, and a cool-down of input passes whose weight passes come last.
    """
    planned, count = max(2 * pp - 1, microbatches), _Counter()
    forward = count.forward

    def input_and_weight(chunk: int) -> list[Action]:
        microbatch = count.take(chunk, INPUT)
        count.take(chunk, WEIGHT)
        return [Action(True, chunk, microbatch, INPUT), Action(True, chunk, microbatch, WEIGHT)]

    actions = [forward(0) for _ in range(2 * (pp - stage) - 1)]
    for _ in range(stage):
        actions += [forward(1), forward(0)]
    for _ in range(pp - stage):
        actions += [forward(1), *input_and_weight(1)]
    while count.next[(1, "forward")] < count.next[(0, "forward")] or count.next[(0, "forward")] < planned:
        if count.next[(0, "forward")] < planned:
            actions.append(forward(0))
        actions += input_and_weight(0) + [forward(1)] + input_and_weight(1)
    for chunks in [(0, 1)] * stage + [(0,)] * (pp - stage):
        for chunk in chunks:
            actions.append(Action(True, chunk, count.take(chunk, INPUT), INPUT))
        if chunks == (0,):
            actions.append(Action(True, 0, count.take(0, WEIGHT), WEIGHT))
    for chunk in (1, 0):
        while count.next[(chunk, WEIGHT)] < count.next[(chunk, INPUT)]:
            actions.append(Action(True, chunk, count.take(chunk, WEIGHT), WEIGHT))
    return [action for action in actions if action.microbatch < microbatches]


def _dual_pipe_v(stage: int, pp: int, microbatches: int) -> list[Action]:
    """torch's ScheduleDualPipeV on V placement (chunk 0 is virtual stage `stage`, chunk 1 is 2 pp - 1 - stage).

    Its overlapped forward-and-backward pairs run one after the other on a rank (torch's runtime without an overlap
    callback): a forward, then a whole backward. Input passes leave their weight passes to a queue that the schedule
    drains into the gaps (step numbers as in torch's code).
    """
    count, queued = _Counter(), []  # queued: (chunk, micro-batch) of input passes whose weight pass is to come
    forward = count.forward

    def backward(chunk: int, *, split: bool = False) -> Action:
        microbatch = count.take(chunk, INPUT)
        if split:
            queued.append((chunk, microbatch))
        return Action(True, chunk, microbatch, INPUT if split else FULL)

    def queued_weight() -> list[Action]:
        return [Action(True, *queued.pop(0), WEIGHT)] if queued else []

    actions = [forward(0) for _ in range(2 * (pp - stage - 1))]  # 1
    for _ in range(stage + 1):  # 2
        actions += [forward(0), forward(1)]
    for _ in range(pp - stage - 1):  # 3
        actions += [backward(1, split=True), *queued_weight(), forward(1)]
    for _ in range(microbatches - 2 * pp + stage + 1):  # 4
        actions += [forward(0), backward(1), forward(1), backward(0)]
    for _ in range(pp - stage - 1):  # 5
        actions += [backward(1), forward(1), backward(0)]
    split = False
    for i in range(stage + 1):  # 6: the second half split
        split = split or (i == (stage + 1) // 2 and stage % 2 == 1)
        actions.append(backward(1, split=split))
        split = split or (i == (stage + 1) // 2 and stage % 2 == 0)
        actions.append(backward(0, split=split))
    for _ in range(pp - stage - 1):  # 7
        actions += [*queued_weight(), backward(0, split=split)]
    for _ in range(stage + 1):  # 8
        actions += queued_weight()
    return actions


def held_at_peaks(actions: Sequence[Action], chunks: int) -> tuple[tuple[int, ...], ...]:
    """The micro-batches each chunk holds when a stage's stash can peak (after each forward), less the moments another
    one matches or exceeds in every chunk: whatever each chunk's stash, its peak is at one of these (`peak_stash`)."""
    held = [0] * chunks
    moments: set[tuple[int, ...]] = set()
    for action in actions:
        if not action.backward:
            held[action.chunk] += 1
            moments.add(tuple(held))
        elif action.frees:
            held[action.chunk] -= 1

    def covered(moment: tuple[int, ...]) -> bool:
        return any(o != moment and all(a >= b for a, b in zip(o, moment, strict=True)) for o in moments)

    return tuple(sorted(m for m in moments if not covered(m)))


def peak_stash(held: Sequence[Sequence[int]], stash_per_chunk: Sequence[float]) -> float:
    """Most activation bytes a stage holds at once (forwards not yet matched by their backward), from
    `held_at_peaks`."""
    weighted = (sum(n * stash for n, stash in zip(counts, stash_per_chunk, strict=True)) for counts in held)
    return max(weighted, default=0.0)
