"""Step simulator: replays each stage's schedule order with per-chunk compute and per-link transfer times.

Every stage runs its actions one after another. A forward of virtual stage k waits for virtual stage k-1's forward
of the same micro-batch plus the activation transfer; a backward waits for virtual stage k+1's backward plus the
gradient transfer (same bytes, same link). The link from one stage to another carries one transfer at a time, in the
order the receiving stage takes them (a pipeline's activations queue behind each other on a slow link, as they do on
a real one).

Point-to-point messages are rendezvous: data moves once the sender has posted its send *and* the receiver its recv,
except, on gloo, a message's first bytes, which the receiver's socket takes before (`early`: a message that fits
crosses whole). A send is done for its sender when the data has arrived (NCCL) or, on gloo, as soon as both sides
have posted, the sockets taking the data (`buffered`). How torch's schedules post and wait (`RENDEZVOUS`, `_gates`):

- GPipe and 1F1B post an action's recv only when the stage is about to run it (after its previous action), so a
  transfer does not overlap the receiver's compute of the action before;
- 1F1B waits for a send in the same batch as the next recv (steady state: the action after it starts only once the
  send is through) or, in warm-up and cool-down, after the next action's compute; GPipe waits for all forward sends
  before its first backward; both wait for their last send before the step's end;
- the schedules with several chunks per stage (torch's schedule runtime) post recvs as soon as the sender's compute
  is scheduled, so transfers overlap compute, and wait for their sends at the end of the step; a hop between two
  virtual stages on one stage (V placement's turn) is a local hand-over.

A zero-bubble schedule splits each backward into an input pass, which the previous virtual stage waits for, and a
weight pass (`weight` seconds of the backward) that waits only for its own stage's order and sends nothing.

After its last backward (and send) a stage spends its exposed DP sync (a "sync" block, with the pipeline's closing
all-reduce of the loss), then its optimizer step; the step ends when the last stage is done.

Which action waits for which does not depend on the durations, so a `Replay` lists the actions once, in an order
where each comes after what it waits for; timing a step is then one pass over that list (the planner times many
partitions of one schedule). For the same reason the chain of waits that set one step (`Replay.critical_path`) is a
chain every split of the schedule has: the partition search bounds other splits by it (`cuts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from typing import NamedTuple

from holmes_lightning.planner.options import Backend, Schedule
from holmes_lightning.planner.plan_types import StagePlan, locate_virtual, virtual_stage
from holmes_lightning.planner.schedules import FULL, INPUT, WEIGHT, Action, held_at_peaks, stage_actions
from holmes_lightning.planner.sharing import CoreSharing, settle

# recv posted just before its action? (torch's schedule runtime, which runs the multi-chunk schedules, posts early)
RENDEZVOUS = {schedule: schedule in (Schedule.GPipe, Schedule["1F1B"]) for schedule in Schedule}
BUFFERED_BACKENDS = {Backend.gloo}  # a send is done once both sides have posted (gloo's TCP sockets take its data)
WAITS_THEN_POSTS = {Schedule.GPipe}  # a gated action's recv is posted after the wait (1F1B: in the same batch)


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
    Per action: its stage (`stage_of`), its virtual stage (`plan_types.virtual_stage`), forward/backward, its part
    (`parts`: a backward's FULL, INPUT or WEIGHT pass; `split`: the schedule has such parts), the index of the action
    it waits for (-1: none), the virtual stage whose transfer lies between them (-1: none), the link that transfer
    takes (`sender * pp + receiver` of the stages; -1: none), the action whose send must be through before it starts
    (`gate`) and before its stage moves on after it (`after_gate`; -1: none). `final_gates[s]`: the sends stage s
    waits for before its step ends. `steps`: i >= 0 runs action i, ~i times the transfer into action i (when its
    stage is about to run it: with `rendezvous`, the transfer starts no earlier, and with `waits_then_posts` no
    earlier than the action's gate either).
    """

    pp: int
    chunks: int
    microbatches: int
    orders: tuple[tuple[Action, ...], ...]
    actions: tuple[tuple[int, Action], ...]
    virtual: tuple[int, ...]
    stage_of: tuple[int, ...]
    backward: tuple[bool, ...]
    parts: tuple[str, ...]
    split: bool
    waits_for: tuple[int, ...]
    transfer: tuple[int, ...]
    link: tuple[int, ...]
    gate: tuple[int, ...]
    after_gate: tuple[int, ...]
    final_gates: tuple[tuple[int, ...], ...]
    steps: tuple[int, ...]
    rendezvous: bool
    waits_then_posts: bool

    @classmethod
    @cache
    def of(cls, schedule: Schedule, pp: int, microbatches: int, chunks: int = 1) -> Replay:
        schedule = Schedule(schedule)
        orders = [stage_actions(schedule, s, pp, microbatches, chunks) for s in range(pp)]
        last, v_shaped = pp * chunks - 1, schedule.v_shaped
        Key = tuple[int, int, int]  # (0 forward, 1 a backward that sends, 2 a weight pass; virtual stage; micro-batch)

        def source_of(action: Action, k: int) -> tuple[Key | None, int]:
            """The action this one waits for and the virtual stage whose transfer lies between them (-1: none); a
            weight pass follows its input pass on the same stage, in the stage's order."""
            if action.part == WEIGHT:
                return None, -1
            if action.backward:
                return ((0, k, action.microbatch), -1) if k == last else ((1, k + 1, action.microbatch), k)
            return (None, -1) if k == 0 else ((0, k - 1, action.microbatch), k - 1)

        def receiver_of(action: Action, k: int) -> Key | None:
            """The action that takes this one's output over a link (None: no send)."""
            if not action.sends:
                return None
            if action.backward:
                return (1, k - 1, action.microbatch) if k > 0 else None
            return (0, k + 1, action.microbatch) if k < last else None

        keys = [
            [
                (
                    2 if a.part == WEIGHT else int(a.backward),
                    virtual_stage(s, a.chunk, pp, v_shaped=v_shaped),
                    a.microbatch,
                )
                for a in order
            ]
            for s, order in enumerate(orders)
        ]
        receivers = [
            [receiver_of(a, key[1]) for a, key in zip(order, stage_keys, strict=True)]
            for order, stage_keys in zip(orders, keys, strict=True)
        ]
        sends = [[r is not None for r in stage_receivers] for stage_receivers in receivers]
        gates = [_gates(schedule, order, sent) for order, sent in zip(orders, sends, strict=True)]
        index: dict[Key, int] = {}
        ran: set[Key] = set()
        arrived: set[Key] = set()
        actions, waits_for, transfer, link, gate, after_gate, steps = [], [], [], [], [], [], []

        def through(s: int, p: int) -> bool:
            """Whether the send of stage s's action at position p (if any) can be timed: its transfer is."""
            return p < 0 or receivers[s][p] is None or receivers[s][p] in arrived

        position = [0] * pp
        while any(position[s] < len(orders[s]) for s in range(pp)):
            progressed = False
            for s in range(pp):
                while position[s] < len(orders[s]):
                    p = position[s]
                    action, key = orders[s][p], keys[s][p]
                    source, via = source_of(action, key[1])
                    if source is not None and source not in ran:
                        break
                    before, after = gates[s][p]
                    if key not in index:
                        index[key] = len(actions)
                        actions.append((s, action))
                        waits_for.append(-1 if source is None else index[source])
                        transfer.append(via)
                        link.append(actions[index[source]][0] * pp + s if via >= 0 else -1)
                        gate.append(index[keys[s][before]] if before >= 0 else -1)
                        after_gate.append(index[keys[s][after]] if after >= 0 else -1)
                    i = index[key]
                    if via >= 0 and key not in arrived:
                        if schedule in WAITS_THEN_POSTS and not through(s, before):
                            break
                        steps.append(~i)
                        arrived.add(key)
                        progressed = True
                    if not (through(s, before) and through(s, after)):
                        break
                    steps.append(i)
                    ran.add(key)
                    position[s] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError(f"{schedule} order deadlocks with {pp} stages and {microbatches} micro-batches")
        final_gates = tuple(
            tuple(index[keys[s][p]] for p in _last_sends(order, sent))
            for s, (order, sent) in enumerate(zip(orders, sends, strict=True))
        )
        return cls(
            pp=pp,
            chunks=chunks,
            microbatches=microbatches,
            orders=tuple(tuple(order) for order in orders),
            actions=tuple(actions),
            virtual=tuple(virtual_stage(s, a.chunk, pp, v_shaped=v_shaped) for s, a in actions),
            stage_of=tuple(s for s, _ in actions),
            backward=tuple(a.backward for _, a in actions),
            parts=tuple(a.part for _, a in actions),
            split=schedule.splits_backward,
            waits_for=tuple(waits_for),
            transfer=tuple(transfer),
            link=tuple(link),
            gate=tuple(gate),
            after_gate=tuple(after_gate),
            final_gates=final_gates,
            steps=tuple(steps),
            rendezvous=RENDEZVOUS[schedule],
            waits_then_posts=schedule in WAITS_THEN_POSTS,
        )

    def ends(
        self,
        forward: Sequence[float],
        backward: Sequence[float],
        send: Sequence[float],
        durations: Sequence[float] | None = None,
        early: Sequence[float] | None = None,
        buffered: bool = False,
        weight: Sequence[float] | None = None,
    ) -> tuple[list[float], list[float]]:
        """End time of every action, and when each stage is done with its actions and sends (seconds per virtual
        stage; `durations`: per action instead, as `sharing.settle` stretches them; `early`: of each send, the
        seconds that may run before the receiver posts its recv; `buffered`: a send is done once both sides have
        posted, its data left to the sockets (gloo), else once the data has arrived (NCCL); `weight`: of each
        backward, its weight pass's seconds, for a schedule that splits them)."""
        ends, clock, _ = self._times(forward, backward, send, durations, early, buffered, weight)
        return ends, clock

    def _times(
        self,
        forward: Sequence[float],
        backward: Sequence[float],
        send: Sequence[float],
        durations: Sequence[float] | None,
        early: Sequence[float] | None,
        buffered: bool,
        weight: Sequence[float] | None,
    ) -> tuple[list[float], list[float], _Moments]:
        """`ends`, and when each action posted its send, its send was through and its input arrived."""
        if durations is None and self.split:
            durations = self.seconds(forward, backward, weight)
        pp, virtual, stage_of, waits_for, transfer = self.pp, self.virtual, self.stage_of, self.waits_for, self.transfer
        clock = [0.0] * pp
        link_free = [0.0] * (pp * pp)  # when each stage-to-stage link has sent what it carried so far
        n = len(self.actions)
        ends = [0.0] * n
        posted = [0.0] * n  # when the stage moved on after each action, i.e. posted its send
        through = [0.0] * n  # when each action's send was done for its sender
        arrival = [0.0] * n  # when each action's input arrived
        rendezvous, waits_then_posts = self.rendezvous, self.waits_then_posts
        gate_of, after_gate_of, link_of, is_backward = self.gate, self.after_gate, self.link, self.backward
        for step in self.steps:
            if step < 0:  # the transfer into action ~step, timed when its stage is about to run it
                i = ~step
                source, link = waits_for[i], link_of[i]
                ready = posted[source]
                waiting = clock[stage_of[i]]  # the receiver posts its recv now
                if waits_then_posts and gate_of[i] >= 0 and through[gate_of[i]] > waiting:
                    waiting = through[gate_of[i]]
                if link_free[link] > ready:
                    ready = link_free[link]
                seconds = send[transfer[i]]
                ready += seconds
                if rendezvous:  # what the receiver's socket cannot take before its recv moves after it
                    late = waiting + seconds - (early[transfer[i]] if early is not None else 0.0)
                    if late > ready:
                        ready = late
                link_free[link] = arrival[i] = ready
                if not buffered:
                    through[source] = ready
                elif rendezvous and waiting > posted[source]:
                    through[source] = waiting
                else:
                    through[source] = posted[source]
                continue
            k, stage = virtual[step], stage_of[step]
            start = clock[stage]
            source = waits_for[step]
            if source >= 0:
                ready = arrival[step] if transfer[step] >= 0 else ends[source]
                if ready > start:
                    start = ready
            gate = gate_of[step]
            if gate >= 0 and through[gate] > start:
                start = through[gate]
            if durations is None:
                end = start + (backward[k] if is_backward[step] else forward[k])
            else:
                end = start + durations[step]
            ends[step] = end
            after = after_gate_of[step]
            if after >= 0 and through[after] > end:
                end = through[after]
            posted[step] = clock[stage] = end
        for stage, gates in enumerate(self.final_gates):
            for gate in gates:
                if through[gate] > clock[stage]:
                    clock[stage] = through[gate]
        return ends, clock, _Moments(posted, through, arrival)

    def shared(
        self,
        forward: Sequence[float],
        backward: Sequence[float],
        send: Sequence[float],
        sharing: CoreSharing,
        early: Sequence[float] | None = None,
        buffered: bool = False,
        weight: Sequence[float] | None = None,
    ) -> tuple[list[float], list[float], list[float]]:
        """`ends` with the ranks sharing CPU cores (`sharing.settle`): every action's seconds, ends, stage clocks."""
        return settle(
            self.seconds(forward, backward, weight),
            self.pp,
            sharing,
            lambda durations: self.ends(forward, backward, send, durations, early, buffered),
        )

    def seconds(
        self, forward: Sequence[float], backward: Sequence[float], weight: Sequence[float] | None = None
    ) -> list[float]:
        """Every action's seconds, from per virtual stage forward, backward and (split backwards) weight seconds."""
        if not self.split:
            return [(backward if self.backward[i] else forward)[k] for i, k in enumerate(self.virtual)]
        if weight is None:
            raise ValueError("a schedule that splits its backwards needs each virtual stage's weight-pass seconds")
        passes = {FULL: backward, WEIGHT: weight, INPUT: [b - w for b, w in zip(backward, weight, strict=True)]}
        return [
            (passes[part] if self.backward[i] else forward)[k]
            for i, (k, part) in enumerate(zip(self.virtual, self.parts, strict=True))
        ]

    def step_s(
        self,
        forward: Sequence[float],
        backward: Sequence[float],
        send: Sequence[float],
        tail: Sequence[float],
        sharing: CoreSharing | None = None,
        early: Sequence[float] | None = None,
        buffered: bool = False,
        weight: Sequence[float] | None = None,
    ) -> float:
        """The step's seconds: the latest stage end plus its tail (exposed sync and optimizer step); `sharing`: the
        ranks share CPU cores (`planner.sharing`); `early`, `buffered`, `weight`: as in `ends`."""
        if sharing is not None and sharing.contended(self.pp):
            _, _, clock = self.shared(forward, backward, send, sharing, early, buffered, weight)
        else:
            _, clock = self.ends(forward, backward, send, early=early, buffered=buffered, weight=weight)
        return max(end + extra for end, extra in zip(clock, tail, strict=True))

    def critical_path(
        self,
        forward: Sequence[float],
        backward: Sequence[float],
        send: Sequence[float],
        tail: Sequence[float],
        early: Sequence[float] | None = None,
        buffered: bool = False,
        weight: Sequence[float] | None = None,
    ) -> CriticalPath:
        """The chain of waits that sets `step_s` of these seconds (ranks on cores of their own), found by walking back
        from the stage that ends last through whatever each start waited for."""
        ends, clock, (posted, through, arrival) = self._times(forward, backward, send, None, early, buffered, weight)
        before, waiting_after, link_before, through_by, last = self._predecessors
        virtual, n = self.virtual, self.pp * self.chunks
        counts = {kind: [0] * n for kind in ("forward", "gradient", "weight", "send", "late")}
        moments = {"posted": posted, "through": through, "arrival": arrival, "end": ends}

        def at(kind: str, i: int) -> float:
            return moments[kind][i] if i >= 0 else 0.0

        def waiting(i: int) -> tuple[str, int]:  # when the receiver of the transfer into action i posted its recv
            gate = self.gate[i]
            if self.waits_then_posts and gate >= 0 and through[gate] > at("posted", waiting_after[i]):
                return "through", gate
            return "posted", waiting_after[i]

        stage = max(range(self.pp), key=lambda s: clock[s] + tail[s])
        node = max(
            [("posted", last[stage])] + [("through", gate) for gate in self.final_gates[stage]], key=lambda n: at(*n)
        )
        while node[1] >= 0:
            kind, i = node
            if kind == "end":
                k = virtual[i]
                if not self.backward[i]:
                    counts["forward"][k] += 1
                else:
                    counts["gradient"][k] += self.parts[i] != WEIGHT
                    counts["weight"][k] += self.parts[i] != INPUT
                source = self.waits_for[i]
                waits = [("posted", before[i]), ("through", self.gate[i])]
                if source >= 0:
                    waits.append(("arrival", i) if self.transfer[i] >= 0 else ("end", source))
                node = max(waits, key=lambda n: at(*n))
            elif kind == "posted":
                node = max([("end", i), ("through", self.after_gate[i])], key=lambda n: at(*n))
            elif kind == "through":
                receiver = through_by[i]
                if not buffered:
                    node = ("arrival", receiver)
                elif self.rendezvous and at(*waiting(receiver)) > posted[i]:
                    node = waiting(receiver)
                else:
                    node = ("posted", i)
            else:  # the transfer into action i
                k, source = self.transfer[i], self.waits_for[i]
                ready = max([("posted", source), ("arrival", link_before[i])], key=lambda n: at(*n))
                late = waiting(i)
                lateness = early[k] if early is not None else 0.0
                if self.rendezvous and at(*late) - lateness > at(*ready):
                    counts["late"][k] += 1
                    node = late
                else:
                    counts["send"][k] += 1
                    node = ready
        return CriticalPath(**{kind: tuple(values) for kind, values in counts.items()}, stage=stage)

    @cached_property
    def held(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Per stage, the micro-batches each chunk holds where its stash can peak (`held_at_peaks` of its order)."""
        return tuple(held_at_peaks(order, self.chunks) for order in self.orders)

    @cached_property
    def _predecessors(self) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """Per action: the one its stage ran before it; for a transfer into it, the last action its stage had run when
        it was timed, and the transfer before it on its link; per sending action, the action it sends to; per stage,
        its last action (-1: none)."""
        n = len(self.actions)
        before, waiting_after, link_before, through_by = [-1] * n, [-1] * n, [-1] * n, [-1] * n
        last, on_link = [-1] * self.pp, {}
        for step in self.steps:
            if step < 0:
                i = ~step
                waiting_after[i] = last[self.stage_of[i]]
                link_before[i] = on_link.get(self.link[i], -1)
                on_link[self.link[i]] = i
                through_by[self.waits_for[i]] = i
            else:
                before[step] = last[self.stage_of[step]]
                last[self.stage_of[step]] = step
        return before, waiting_after, link_before, through_by, last


class _Moments(NamedTuple):
    """Per action of a replayed step: when it posted its send, when that send was through, when its input arrived."""

    posted: list[float]
    through: list[float]
    arrival: list[float]


@dataclass(frozen=True)
class CriticalPath:
    """A chain of waits through one step's actions: how many times it runs each virtual stage's forward, input pass
    (the whole backward where a schedule does not split it), weight pass and transfer (`late`: a rendezvous
    transfer less its `early` seconds), and the stage whose tail ends it.

    Which action waits for which does not depend on the seconds, so under any seconds its length (`length_s`) is at
    most the simulated step (ranks on cores of their own), and under the seconds it was found for it is the step.
    """

    forward: tuple[int, ...]
    gradient: tuple[int, ...]
    weight: tuple[int, ...]
    send: tuple[int, ...]
    late: tuple[int, ...]
    stage: int

    def length_s(
        self,
        forward: Sequence[float],
        gradient: Sequence[float],
        weight: Sequence[float],
        send: Sequence[float],
        early: Sequence[float],
        tail: Sequence[float],
    ) -> float:
        """Its seconds, per virtual stage: forward, input pass, weight pass, transfer and its early part; per stage its
        tail."""
        total = tail[self.stage]
        for k in range(len(forward)):
            total += self.forward[k] * forward[k] + self.gradient[k] * gradient[k] + self.weight[k] * weight[k]
            total += self.send[k] * send[k] + self.late[k] * (send[k] - early[k])
        return total


def _gates(schedule: Schedule, order: Sequence[Action], sends: Sequence[bool]) -> list[tuple[int, int]]:
    """Per action of one stage: the positions of the actions whose sends it waits for before it starts and before the
    stage moves on after it (-1: none), as torch's schedule batches and waits its sends (module docstring)."""
    gates = [(-1, -1)] * len(order)
    if schedule == Schedule.GPipe:
        forwards = [p for p, action in enumerate(order) if not action.backward]
        if forwards and forwards[-1] + 1 < len(order) and sends[forwards[-1]]:
            gates[forwards[-1] + 1] = (forwards[-1], -1)
    elif schedule == Schedule["1F1B"]:
        for p in range(1, len(order)):
            if not sends[p - 1]:
                continue
            same_kind = order[p].backward == order[p - 1].backward  # warm-up forwards, cool-down backwards
            gates[p] = (-1, p - 1) if same_kind else (p - 1, -1)
    return gates


def _last_sends(order: Sequence[Action], sends: Sequence[bool]) -> list[int]:
    """The positions of a stage's last forward and last backward that send: every send is through before it ends."""
    return [
        max(p for p, action in enumerate(order) if action.backward == backward and sends[p])
        for backward in (False, True)
        if any(action.backward == backward and sends[p] for p, action in enumerate(order))
    ]


def simulate(
    stages: Sequence[StagePlan],
    schedule: Schedule,
    microbatches: int,
    *,
    shared_cores: float | None = None,
    backend: Backend = Backend.nccl,
) -> Timeline:
    """Replay one optimizer step of `stages` (each with per-chunk forward/backward/send seconds); `shared_cores`: every
    rank computes on this many CPU cores of one machine (`planner.sharing`); on `backend` gloo sends are buffered
    (`Replay.ends`)."""
    buffered = backend in BUFFERED_BACKENDS
    pp = len(stages)
    chunks = len(stages[0].chunks)
    replay = Replay.of(schedule, pp, microbatches, chunks)
    located = (locate_virtual(k, pp, v_shaped=Schedule(schedule).v_shaped) for k in range(pp * chunks))
    per_virtual = [(stages[stage], chunk) for stage, chunk in located]
    forward = [stage.forward_s[j] for stage, j in per_virtual]
    backward = [stage.backward_s[j] for stage, j in per_virtual]
    send = [stage.send_s[j] for stage, j in per_virtual]
    early = [stage.early_s[j] if stage.early_s else 0.0 for stage, j in per_virtual]
    weight = [stage.weight_s[j] if stage.weight_s else 0.0 for stage, j in per_virtual]
    sharing = None if shared_cores is None else CoreSharing(shared_cores, len(stages[0].ranks))
    if sharing is not None and sharing.contended(pp):
        durations, ends, clock = replay.shared(forward, backward, send, sharing, early, buffered, weight)
    else:
        ends, clock = replay.ends(forward, backward, send, early=early, buffered=buffered, weight=weight)
        durations = replay.seconds(forward, backward, weight)
    blocks = []
    for (s, action), end, seconds in zip(replay.actions, ends, durations, strict=True):
        kind = ("weight" if action.part == WEIGHT else "backward") if action.backward else "forward"
        blocks.append(Block(s, kind, action.chunk, action.microbatch, end - seconds, end))
    synced = [clock[s] + stage.exposed_sync_s + stage.closing_s for s, stage in enumerate(stages)]
    finished = tuple(synced[s] + stage.update_s for s, stage in enumerate(stages))
    blocks += [Block(s, "sync", 0, -1, clock[s], synced[s]) for s in range(pp)]
    blocks += [Block(s, "optimizer", 0, -1, synced[s], finished[s]) for s in range(pp) if finished[s] > synced[s]]
    return Timeline(tuple(blocks), finished)
