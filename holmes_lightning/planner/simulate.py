"""Step simulator: replays each stage's schedule order with per-chunk compute and per-link transfer times.

Every stage runs its actions one after another. A forward of virtual stage k waits for virtual stage k-1's forward
of the same micro-batch plus the activation transfer; a backward waits for virtual stage k+1's backward plus the
gradient transfer (same bytes, same link). Transfers overlap compute and do not contend for links. After its last
backward a stage spends its exposed DP sync, then its optimizer step; the step ends when the last stage is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from holmes_lightning.planner.plan_types import StagePlan, locate_virtual, virtual_stage
from holmes_lightning.planner.schedules import Action, stage_actions


@dataclass(frozen=True)
class Block:
    """One interval of one stage's time line: a forward, a backward, or the DP sync and optimizer step at the end."""

    stage: int
    kind: str
    chunk: int
    microbatch: int
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Every block of one simulated step; `stage_end_s[s]`: when stage s finishes its optimizer step."""

    blocks: tuple[Block, ...]
    stage_end_s: tuple[float, ...]

    @property
    def total_s(self) -> float:
        return max(self.stage_end_s)

    def stage_blocks(self, stage: int) -> list[Block]:
        return [block for block in self.blocks if block.stage == stage]


def simulate(stages: Sequence[StagePlan], schedule: str, microbatches: int) -> Timeline:
    """Replay one optimizer step of `stages` (each with per-chunk forward/backward/send seconds)."""
    pp = len(stages)
    chunks = len(stages[0].chunks)
    virtual = pp * chunks
    orders = [stage_actions(schedule, s, pp, microbatches, chunks) for s in range(pp)]
    done: dict[tuple[bool, int, int], float] = {}
    clock = [0.0] * pp
    position = [0] * pp
    blocks: list[Block] = []

    def ready(stage: int, action: Action) -> float | None:
        k = virtual_stage(stage, action.chunk, pp)
        if not action.backward:
            if k == 0:
                return 0.0
            previous = done.get((False, k - 1, action.microbatch))
            return None if previous is None else previous + _send(stages, k - 1, pp)
        if k == virtual - 1:
            return done.get((False, k, action.microbatch))
        following = done.get((True, k + 1, action.microbatch))
        return None if following is None else following + _send(stages, k, pp)

    while any(position[s] < len(orders[s]) for s in range(pp)):
        progressed = False
        for s, stage in enumerate(stages):
            while position[s] < len(orders[s]):
                action = orders[s][position[s]]
                start = ready(s, action)
                if start is None:
                    break
                start = max(start, clock[s])
                seconds = (stage.backward_s if action.backward else stage.forward_s)[action.chunk]
                clock[s] = start + seconds
                done[(action.backward, virtual_stage(s, action.chunk, pp), action.microbatch)] = clock[s]
                kind = "backward" if action.backward else "forward"
                blocks.append(Block(s, kind, action.chunk, action.microbatch, start, clock[s]))
                position[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} order deadlocks with {pp} stages and {microbatches} micro-batches")
    synced = [clock[s] + stage.exposed_sync_s for s, stage in enumerate(stages)]
    ends = tuple(synced[s] + stage.update_s for s, stage in enumerate(stages))
    blocks += [Block(s, "sync", 0, -1, clock[s], synced[s]) for s in range(pp)]
    blocks += [Block(s, "optimizer", 0, -1, synced[s], ends[s]) for s in range(pp) if ends[s] > synced[s]]
    return Timeline(tuple(blocks), ends)


def _send(stages: Sequence[StagePlan], virtual: int, pp: int) -> float:
    """Seconds to move one micro-batch's activation (or its gradient) from virtual stage k to k+1."""
    stage, chunk = locate_virtual(virtual, pp)
    return stages[stage].send_s[chunk]
