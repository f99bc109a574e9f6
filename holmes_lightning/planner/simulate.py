"""Step simulator: replays each stage's schedule order with per-chunk compute and per-link transfer times.

Every stage runs its actions one after another. A forward of virtual stage k waits for virtual stage k-1's forward
of the same micro-batch plus the activation transfer; a backward waits for virtual stage k+1's backward plus the
gradient transfer (same bytes, same link). Transfers overlap compute; the link from one stage to another carries one
transfer at a time, in the order the receiving stage takes them (a pipeline's activations queue behind each other on
a slow link, as they do on a real one). After its last
backward a stage spends its exposed DP sync (a "sync" block, with the pipeline's closing all-reduce of the loss), then
its optimizer step; the step ends when the last stage is done.

Which action waits for which does not depend on the durations, so a `Replay` lists the actions once, in an order
where each comes after what it waits for; timing a step is then one pass over that list (the planner times many
partitions of one schedule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

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


@dataclass(frozen=True)
class Replay:
    """Every action of one step (`pp` stages, `chunks` per stage, `microbatches`), each after what it waits for.

    `orders[s]`: stage s's actions in the order it runs them.
    Per action: its stage, its virtual stage (`chunk * pp + stage`), forward/backward, the index of the action it
    waits for (-1: none), the virtual stage whose transfer lies between them (-1: none) and the link that transfer
    takes (`sender * pp + receiver` of the stages; -1: none).
    """

    pp: int
    chunks: int
    microbatches: int
    orders: tuple[tuple[Action, ...], ...]
    actions: tuple[tuple[int, Action], ...]
    virtual: tuple[int, ...]
    backward: tuple[bool, ...]
    waits_for: tuple[int, ...]
    transfer: tuple[int, ...]
    link: tuple[int, ...]

    @classmethod
    @cache
    def of(cls, schedule: str, pp: int, microbatches: int, chunks: int = 1) -> Replay:
        orders = [stage_actions(schedule, s, pp, microbatches, chunks) for s in range(pp)]
        last = pp * chunks - 1
        index: dict[tuple[bool, int, int], int] = {}
        actions, waits_for, transfer, link = [], [], [], []
        position = [0] * pp
        while any(position[s] < len(orders[s]) for s in range(pp)):
            progressed = False
            for s in range(pp):
                while position[s] < len(orders[s]):
                    action = orders[s][position[s]]
                    k = virtual_stage(s, action.chunk, pp)
                    if action.backward:
                        source, via = (
                            ((False, k, action.microbatch), -1) if k == last else ((True, k + 1, action.microbatch), k)
                        )
                    else:
                        source, via = (None, -1) if k == 0 else ((False, k - 1, action.microbatch), k - 1)
                    if source is not None and source not in index:
                        break
                    index[(action.backward, k, action.microbatch)] = len(actions)
                    waits_for.append(-1 if source is None else index[source])
                    transfer.append(via)
                    link.append(actions[waits_for[-1]][0] * pp + s if via >= 0 else -1)
                    actions.append((s, action))
                    position[s] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError(f"{schedule} order deadlocks with {pp} stages and {microbatches} micro-batches")
        return cls(
            pp=pp,
            chunks=chunks,
            microbatches=microbatches,
            orders=tuple(tuple(order) for order in orders),
            actions=tuple(actions),
            virtual=tuple(virtual_stage(s, a.chunk, pp) for s, a in actions),
            backward=tuple(a.backward for _, a in actions),
            waits_for=tuple(waits_for),
            transfer=tuple(transfer),
            link=tuple(link),
        )

    def ends(
        self, forward: Sequence[float], backward: Sequence[float], send: Sequence[float]
    ) -> tuple[list[float], list[float]]:
        """End time of every action, and when each stage's last action ends (per virtual stage seconds)."""
        pp = self.pp
        clock = [0.0] * pp
        link_free = [0.0] * (pp * pp)  # when each stage-to-stage link has sent what it carried so far
        ends = [0.0] * len(self.actions)
        for i, (k, is_backward, source, via, link) in enumerate(
            zip(self.virtual, self.backward, self.waits_for, self.transfer, self.link, strict=True)
        ):
            stage = k % pp  # locate_virtual(k, pp)[0], inlined: this loop times every action of every split
            start = clock[stage]
            if source >= 0:
                ready = ends[source]
                if via >= 0:
                    if link_free[link] > ready:
                        ready = link_free[link]
                    ready += send[via]
                    link_free[link] = ready
                if ready > start:
                    start = ready
            end = start + (backward[k] if is_backward else forward[k])
            ends[i] = end
            clock[stage] = end
        return ends, clock

    def step_s(
        self, forward: Sequence[float], backward: Sequence[float], send: Sequence[float], tail: Sequence[float]
    ) -> float:
        """The step's seconds: the latest stage end plus its tail (exposed sync and optimizer step)."""
        _, clock = self.ends(forward, backward, send)
        return max(end + extra for end, extra in zip(clock, tail, strict=True))


def simulate(stages: Sequence[StagePlan], schedule: str, microbatches: int) -> Timeline:
    """Replay one optimizer step of `stages` (each with per-chunk forward/backward/send seconds)."""
    pp = len(stages)
    chunks = len(stages[0].chunks)
    replay = Replay.of(schedule, pp, microbatches, chunks)
    per_virtual = [(stages[stage], chunk) for stage, chunk in (locate_virtual(k, pp) for k in range(pp * chunks))]
    ends, clock = replay.ends(
        [stage.forward_s[j] for stage, j in per_virtual],
        [stage.backward_s[j] for stage, j in per_virtual],
        [stage.send_s[j] for stage, j in per_virtual],
    )
    blocks = []
    for (s, action), end in zip(replay.actions, ends, strict=True):
        seconds = (stages[s].backward_s if action.backward else stages[s].forward_s)[action.chunk]
        kind = "backward" if action.backward else "forward"
        blocks.append(Block(s, kind, action.chunk, action.microbatch, end - seconds, end))
    synced = [clock[s] + stage.exposed_sync_s + stage.closing_s for s, stage in enumerate(stages)]
    finished = tuple(synced[s] + stage.update_s for s, stage in enumerate(stages))
    blocks += [Block(s, "sync", 0, -1, clock[s], synced[s]) for s in range(pp)]
    blocks += [Block(s, "optimizer", 0, -1, synced[s], finished[s]) for s in range(pp) if finished[s] > synced[s]]
    return Timeline(tuple(blocks), finished)
