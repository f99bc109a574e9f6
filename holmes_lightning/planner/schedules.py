"""Per-stage action orders of the pipeline schedules, as torch.distributed.pipelining runs them (no processes here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from holmes_lightning.planner.options import Schedule


@dataclass(frozen=True)
class Action:
    """One forward or backward of one micro-batch through one of a stage's chunks."""

    backward: bool
    chunk: int
    microbatch: int


def microbatch_problem(schedule: Schedule, pp: int, microbatches: int) -> str | None:
    """Why torch's schedule would refuse this micro-batch count for `pp` stages, or None."""
    if schedule == Schedule["1F1B"] and microbatches < pp:
        return f"schedule 1F1B needs microbatches >= stages, got {microbatches} < {pp}"
    rounds = max(1, microbatches // pp)
    if schedule == Schedule.Interleaved1F1B and microbatches % rounds:
        return (
            f"schedule Interleaved1F1B needs microbatches to be a multiple of max(1, microbatches // pp) = {rounds}, "
            f"got {microbatches} with pp={pp}"
        )
    return None


def stage_actions(schedule: Schedule, stage: int, pp: int, microbatches: int, chunks: int = 1) -> list[Action]:
    """The order in which `stage` of `pp` runs its forwards and backwards (`chunks` > 1: interleaved)."""
    if schedule == Schedule.GPipe:
        forwards = [Action(False, 0, mb) for mb in range(microbatches)]
        return forwards + [Action(True, 0, mb) for mb in range(microbatches)]
    if schedule == Schedule["1F1B"]:
        return _one_f_one_b(stage, pp, microbatches)
    if schedule == Schedule.Interleaved1F1B:
        return _interleaved(stage, pp, microbatches, chunks)
    raise ValueError(f"schedule={schedule!r} is not modelled; use one of {', '.join(Schedule)}")


def _one_f_one_b(stage: int, pp: int, microbatches: int) -> list[Action]:
    """torch's Schedule1F1B: `pp - stage` warm-up forwards, then backward/forward pairs, then the last backwards."""
    warmup = min(microbatches, pp - stage)
    actions = [Action(False, 0, mb) for mb in range(warmup)]
    for backward_mb in range(microbatches):
        actions.append(Action(True, 0, backward_mb))
        if warmup + backward_mb < microbatches:
            actions.append(Action(False, 0, warmup + backward_mb))
    return actions


def _interleaved(stage: int, pp: int, microbatches: int, chunks: int) -> list[Action]:
    """torch's ScheduleInterleaved1F1B: micro-batches in rounds of `per_round`, chunks visited round by round."""
    per_round = microbatches // max(1, microbatches // pp)
    total = microbatches * chunks
    warmup = min((chunks - 1) * per_round + 2 * (pp - 1 - stage), total)
    next_mb = {"forward": [0] * chunks, "backward": [0] * chunks}

    def forward(step: int) -> Action:
        chunk = (step // per_round) % chunks
        next_mb["forward"][chunk] += 1
        return Action(False, chunk, next_mb["forward"][chunk] - 1)

    def backward(step: int) -> Action:
        chunk = chunks - 1 - (step // per_round) % chunks
        next_mb["backward"][chunk] += 1
        return Action(True, chunk, next_mb["backward"][chunk] - 1)

    actions = [forward(step) for step in range(warmup)]
    for step in range(warmup, total):
        actions += [forward(step), backward(step - warmup)]
    actions += [backward(step) for step in range(total - warmup, total)]
    return actions


def held_at_peaks(actions: Sequence[Action], chunks: int) -> tuple[tuple[int, ...], ...]:
    """The micro-batches each chunk holds when a stage's stash can peak (after each forward), less the moments another
    one matches or exceeds in every chunk: whatever each chunk's stash, its peak is at one of these (`peak_stash`)."""
    held = [0] * chunks
    moments: set[tuple[int, ...]] = set()
    for action in actions:
        held[action.chunk] += -1 if action.backward else 1
        if not action.backward:
            moments.add(tuple(held))

    def covered(moment: tuple[int, ...]) -> bool:
        return any(o != moment and all(a >= b for a, b in zip(o, moment, strict=True)) for o in moments)

    return tuple(sorted(m for m in moments if not covered(m)))


def peak_stash(held: Sequence[Sequence[int]], stash_per_chunk: Sequence[float]) -> float:
    """Most activation bytes a stage holds at once (forwards not yet matched by their backward), from
    `held_at_peaks`."""
    weighted = (sum(n * stash for n, stash in zip(counts, stash_per_chunk, strict=True)) for counts in held)
    return max(weighted, default=0.0)
