"""One candidate plan, a layout at one micro-batch count: costs of any layer range on any stage, exact stage plans."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from holmes_lightning.planner.bounds import PathShapes
from holmes_lightning.planner.cost import CostModel
from holmes_lightning.planner.layout import Layout, StageHardware
from holmes_lightning.planner.options import Backend, Checkpointing, Schedule
from holmes_lightning.planner.plan_types import StagePlan, StepPrediction, locate_virtual, virtual_stages
from holmes_lightning.planner.profile import ModelProfile
from holmes_lightning.planner.schedules import peak_stash
from holmes_lightning.planner.sharing import CoreSharing
from holmes_lightning.planner.simulate import BUFFERED_BACKENDS, Replay, simulate
from holmes_lightning.topology import Link

GB = 1e9


@dataclass
class RangeCosts:
    """`Candidate.range_cost` results, for candidates of one cost model and micro-batch size to share: a stage's
    costs depend on its speed, links, DP size and order, not on where the layout puts it."""

    ids: dict[tuple, int] = field(default_factory=dict)
    values: dict[tuple, tuple[tuple[float, float, float, float, float], float] | None] = field(default_factory=dict)
    terms: dict[tuple, object] = field(default_factory=dict)  # `cuts`: ranges per `range_kind`, tables per candidate

    def stage_id(self, stage: tuple) -> int:
        return self.ids.setdefault(stage, len(self.ids))


@dataclass
class Candidate:
    """Seconds and bytes of any layer range on any stage of `layout` (prefix sums: two lookups per range).

    Virtual stage v (`chunks` per stage) sits on stage `located[v][0]`: v % pp in loop placement (interleaved), or
    the V's (`Schedule.v_shaped`); `own[s]`: the virtual stages of stage s by chunk. Counts are layers per virtual
    stage.
    `memory_limit`: bytes per device, None = unchecked. `shapes`: what the bounds need of the schedule's orders.
    `checkpointing`: the activation checkpointing a stage may run (resolved: off, selective, full), cheapest first;
    each stage runs the first whose memory fits `memory_limit` (its level). Checkpointed layers keep only their input
    per micro-batch and run their forward again in backward, their stash back in memory meanwhile.
    `memory_ceiling`: bytes per device a stage may take at its level (None: the limit alone); lowering it looks for
    plans that take less memory without turning on more checkpointing (the least-memory pass lowers it as it goes).
    """

    layout: Layout
    hardware: StageHardware
    cost: CostModel
    schedule: Schedule
    chunks: int
    microbatches: int
    microbatch_size: int
    memory_limit: float | None = None
    range_costs: RangeCosts = field(default_factory=lambda: RangeCosts())
    checkpointing: tuple[Checkpointing, ...] = (Checkpointing.off,)
    memory_ceiling: float | None = None

    def __post_init__(self) -> None:
        self.schedule = Schedule(self.schedule)
        pp, layers, mb = self.layout.pp, self.cost.profile.layers, self.microbatch_size
        self.virtual = pp * self.chunks
        v_shaped = self.schedule.v_shaped
        self.located = [locate_virtual(v, pp, v_shaped=v_shaped) for v in range(self.virtual)]
        self.own = [virtual_stages(s, self.chunks, pp, v_shaped=v_shaped) for s in range(pp)]
        self.replay = Replay.of(self.schedule, pp, self.microbatches, self.chunks)
        cores = self.cost.machine.shared_cores
        self.sharing = None if cores is None else CoreSharing(cores, self.layout.dp)
        # the optimizer step (and a pass without pipeline) runs while every rank computes
        self.all_busy = 1.0 if self.sharing is None else self.sharing.all_busy(pp)
        self.buffered = self.cost.backend in BUFFERED_BACKENDS
        self.held = self.replay.held  # worked out once per schedule, pp, micro-batches and chunks
        self.in_flight = [peak_stash(held, [1.0] * self.chunks) for held in self.held]
        self.shapes = PathShapes.of(self.schedule, pp, self.microbatches, self.chunks, gated=not self.buffered)
        hardware, dp = self.hardware, self.layout.dp
        order = self.in_flight if self.chunks == 1 else range(pp)  # what memory needs of each stage's order
        self.pipelined = self.virtual > 1
        self._stage_ids = [
            self.range_costs.stage_id(
                (hardware.tflops[s], hardware.dp_links[s], hardware.send_links[s], order[s], dp, self.pipelined)
            )
            for s in range(pp)
        ]
        reruns = [mode.recomputed(len(layers)) for mode in self.checkpointing]
        self.splits = self.schedule.splits_backward
        per_speed, shares = {}, self.cost.weight_shares()
        for speed in set(self.hardware.tflops):
            forward, backward = self.cost.microbatch_seconds(speed, mb, dp=dp, pipelined=self.pipelined)
            per_level = [
                _cumulative([b + f * again for f, b, again in zip(forward, backward, rerun, strict=True)])
                for rerun in reruns
            ]
            weight = [b * share if self.splits else 0.0 for b, share in zip(backward, shares, strict=True)]
            per_speed[speed] = (_cumulative(forward), per_level, _cumulative(weight))
        self._forward = [per_speed[speed][0] for speed in self.hardware.tflops]
        self._backward = [per_speed[speed][1] for speed in self.hardware.tflops]  # [stage][level]
        self._weight = [per_speed[speed][2] for speed in self.hardware.tflops]
        self._params = _cumulative([layer.param_bytes for layer in layers])
        frozen = [layer.frozen_bytes for layer in layers]
        self._frozen = _cumulative(frozen) if any(frozen) else None  # None: every parameter trains
        self._stash = [
            _cumulative([self._kept_bytes(i, again) * mb for i, again in enumerate(rerun)]) for rerun in reruns
        ]
        self._rerun = [
            [layer.stash_bytes * mb * again for layer, again in zip(layers, rerun, strict=True)] for rerun in reruns
        ]
        fastest = max(self.hardware.tflops)
        forward, backward = self.cost.layer_seconds(fastest)
        self._base = _cumulative([(f + b) * mb for f, b in zip(forward, backward, strict=True)])
        self.slowdown = [fastest / tflops for tflops in self.hardware.tflops]
        self._activation = [layer.activation_bytes * mb for layer in layers]
        self._least_activation = min(self._activation[:-1], default=0.0)  # a stage never ends at the last layer but one
        # the link out of each virtual stage to the next (None: the last sends nothing)
        self._out_links = [self._hop_link(v) for v in range(self.virtual - 1)] + [None]
        self._range_kinds = [
            (self._stage_ids[stage], chunk, self._out_links[v]) for v, (stage, chunk) in enumerate(self.located)
        ]

    def _hop_link(self, virtual_stage: int) -> Link | None:
        """The link from a virtual stage to the next: the one between their stages, which links hold in pipeline order
        (`send_links[s]`: stage s to s + 1, the last to the first); None at V placement's turn, where both chunks are
        on one rank and torch's schedule runtime hands the activation over locally."""
        sender, receiver = self.located[virtual_stage][0], self.located[virtual_stage + 1][0]
        if sender == receiver and self.schedule.v_shaped:
            return None
        return self.hardware.send_links[sender if receiver == (sender + 1) % self.layout.pp else receiver]

    def describe(self) -> str:
        """The candidate in a few words, for progress reports."""
        return (
            f"pp={self.layout.pp} x dp={self.layout.dp}, {self.schedule.value}, {self.microbatches} micro-batches, "
            f"{self.cost.sharding.value}"
        )

    @property
    def num_layers(self) -> int:
        return self.cost.profile.num_layers

    def _kept_bytes(self, index: int, checkpointed: bool) -> float:
        """What layer `index` keeps per sample for its backward: its stash, or checkpointed its input (the last
        layer also its output and the loss's copy of it, which the pipeline keeps whatever the layer does)."""
        profile = self.cost.profile
        layer = profile.layers[index]
        if not checkpointed:
            return layer.stash_bytes
        last = index == profile.num_layers - 1
        return profile.input_of(index) + (2 * layer.activation_bytes if last else 0.0)

    def forward_s(self, stage: int, start: int, stop: int) -> float:
        return self._forward[stage][stop] - self._forward[stage][start]

    def backward_s(self, stage: int, start: int, stop: int, level: int = 0) -> float:
        """One micro-batch's backward through layers [start, stop) on `stage`, its forward again where `level`'s
        checkpointing says."""
        cumulative = self._backward[stage][level]
        return cumulative[stop] - cumulative[start]

    def weight_s(self, stage: int, start: int, stop: int) -> float:
        """Of `backward_s`, the weight-gradient pass a zero-bubble schedule runs apart (0 for other schedules); a
        checkpointed layer runs its forward again before its input pass, so this does not depend on the level."""
        return self._weight[stage][stop] - self._weight[stage][start]

    def gradient_s(self, stage: int, start: int, stop: int, level: int = 0) -> float:
        """What the previous virtual stage waits for of one backward: all of it, or its input pass alone where the
        weight pass runs apart (the partition search's paths follow these; `weight_s` counts on the stage only)."""
        return self.backward_s(stage, start, stop, level) - self.weight_s(stage, start, stop)

    def send_s(self, virtual_stage: int, stop: int) -> float:
        """One micro-batch's activation (or gradient) from a virtual stage ending at layer `stop` to the next one."""
        link = self._out_links[virtual_stage]
        return 0.0 if link is None else self.cost.transfer_s(self._activation[stop - 1], link)

    def message_cpu_s(self, virtual_stage: int, *, backward: bool = False) -> float:
        """The CPU of the message a virtual stage's forward (to the next) or backward (to the previous) sends."""
        if backward:
            sends = virtual_stage > 0 and self._out_links[virtual_stage - 1] is not None
        else:
            sends = self._out_links[virtual_stage] is not None
        return self.cost.pass_message_cpu_s if sends else 0.0

    def early_s(self, virtual_stage: int, stop: int) -> float:
        """Of `send_s`, the seconds that may run before the receiver posts its recv (gloo)."""
        link = self._out_links[virtual_stage]
        return 0.0 if link is None else self.cost.early_s(self._activation[stop - 1], link)

    def base_work_s(self, start: int, stop: int) -> float:
        """Forward + backward of one micro-batch through layers [start, stop) on the fastest stage, less the per-layer
        overhead: stage s takes at least `slowdown[s]` times this for them."""
        return self._base[stop] - self._base[start]

    def least_send_s(self, virtual_stage: int) -> float:
        """The shortest `send_s` of a virtual stage, wherever it ends."""
        link = self._out_links[virtual_stage]
        return 0.0 if link is None else self.cost.transfer_s(self._least_activation, link)

    def param_bytes(self, start: int, stop: int) -> float:
        return self._params[stop] - self._params[start]

    def frozen_bytes(self, start: int, stop: int) -> float:
        """Of `param_bytes`, those of parameters that do not train."""
        return 0.0 if self._frozen is None else self._frozen[stop] - self._frozen[start]

    def stash_bytes(self, start: int, stop: int, level: int = 0) -> float:
        """Activations one micro-batch leaves for the backward pass in layers [start, stop) at checkpointing `level`."""
        return self._stash[level][stop] - self._stash[level][start]

    def sync_s(self, stage: int, param_bytes: float, layers: int, frozen_bytes: float = 0.0) -> float:
        dp_link = self.hardware.dp_links[stage]
        return self.cost.dp_sync_s(
            self.layout.dp, dp_link, param_bytes, layers=layers, pipelined=self.pipelined, frozen_bytes=frozen_bytes
        )

    def exposed_sync_s(
        self, stage: int, param_bytes: float, layers: int, compute_s: float, frozen_bytes: float = 0.0
    ) -> float:
        """The sync of a stage of `layers` layers that its computation (`compute_s`: one micro-batch's forward and
        backward) does not hide."""
        sync = self.sync_s(stage, param_bytes, layers, frozen_bytes)
        return self.cost.exposed_sync_s(sync, compute_s * self.all_busy, pipelined=self.pipelined)

    def update_s(self, param_bytes: float, layers: int, frozen_bytes: float = 0.0) -> float:
        update = self.cost.update_s(
            param_bytes, self.layout.dp, layers=layers, pipelined=self.pipelined, frozen_bytes=frozen_bytes
        )
        return update * self.all_busy

    def tail_s(self, stage: int, param_bytes: float, layers: int, compute_s: float, frozen_bytes: float = 0.0) -> float:
        """What follows a stage's last backward: the sync the computation does not hide, the optimizer step, and a
        pipeline's closing all-reduce of the loss over every rank (`frozen_bytes`: of the parameters, those that do
        not train)."""
        exposed = self.exposed_sync_s(stage, param_bytes, layers, compute_s, frozen_bytes)
        return exposed + self.update_s(param_bytes, layers, frozen_bytes) + self.closing_s

    @property
    def closing_s(self) -> float:
        """A pipeline's closing all-reduce of the loss over every rank (0 without a pipeline)."""
        return self.cost.step_collective_s(self.layout.pp * self.layout.dp) if self.pipelined else 0.0

    def tail_share_s(self, stage: int, start: int, stop: int) -> float:
        """What layers [start, stop) add at least to their stage's tail in a pipeline (whose sync runs after the
        schedule, all exposed): `closing_s` plus the shares of a stage's chunks is at most its `tail_s`."""
        params, layers, frozen = self.param_bytes(start, stop), stop - start, self.frozen_bytes(start, stop)
        dp_link = self.hardware.dp_links[stage]
        sync = self.cost.dp_sync_s(
            self.layout.dp, dp_link, params, layers=layers, pipelined=True, share=True, frozen_bytes=frozen
        )
        return sync + self.update_s(params, layers, frozen)

    def memory_bytes(
        self, stage: int, param_bytes: float, ranges: Sequence[tuple[int, int] | None], level: int = 0
    ) -> float:
        """Peak bytes per device of a stage holding these parameters, its chunks over layer `ranges` (None, or
        missing at the end: a chunk not placed yet, counted empty), at checkpointing `level`: each chunk's stash per
        micro-batch in flight, and the largest checkpointed layer's stash while its forward runs again."""
        placed = [r for r in ranges if r is not None]
        if self.chunks == 1:
            stash = self.in_flight[stage] * sum(self.stash_bytes(a, b, level) for a, b in placed)
        else:
            per_chunk = [0.0 if r is None else self.stash_bytes(*r, level) for r in ranges]
            stash = peak_stash(self.held[stage], per_chunk + [0.0] * (self.chunks - len(per_chunk)))
        rerun = self._rerun[level]
        again = max((max(rerun[a:b]) for a, b in placed), default=0.0) if any(rerun) else 0.0
        frozen = sum(self.frozen_bytes(a, b) for a, b in placed) if self._frozen is not None else 0.0
        return self.cost.memory_bytes(
            param_bytes, dp=self.layout.dp, stash_bytes=stash + again, pipelined=self.virtual > 1, frozen_bytes=frozen
        )

    def level(self, stage: int, param_bytes: float, ranges: Sequence[tuple[int, int] | None]) -> int | None:
        """The checkpointing a stage holding these parameters and `ranges` runs: the first of `checkpointing` whose
        memory fits the limit (None: none does, or that one goes over `memory_ceiling`)."""
        found = self._level_and_memory(stage, param_bytes, ranges)
        if found is None or not self._under_ceiling(found[1]):
            return None
        return found[0]

    def _level_and_memory(
        self, stage: int, param_bytes: float, ranges: Sequence[tuple[int, int] | None]
    ) -> tuple[int, float] | None:
        for level in range(len(self.checkpointing)):
            memory = self.memory_bytes(stage, param_bytes, ranges, level)
            if self.memory_limit is None or memory <= self.memory_limit:
                return level, memory
        return None

    def _under_ceiling(self, memory: float) -> bool:
        return self.memory_ceiling is None or memory <= self.memory_ceiling

    def range_cost(self, virtual_stage: int, start: int, stop: int) -> tuple[float, float, float, float, float] | None:
        """(forward, backward, send, tail, weight) seconds of one virtual stage alone; None if it alone exceeds
        memory. The backward is `gradient_s` (a zero-bubble schedule's input pass), the weight `weight_s`.

        With several chunks per stage the tail depends on all of them, so it counts as 0 here (a lower bound). Kept in
        `range_costs` by what they depend on, which candidates of one cost model and micro-batch size may share
        whatever their memory ceiling (kept with the range's memory, the ceiling applied here).
        """
        found = self._kept_range_cost(virtual_stage, start, stop)
        if found is None or not self._under_ceiling(found[1]):
            return None
        return found[0]

    def range_kind(self, virtual_stage: int) -> tuple:
        """What a virtual stage's `range_cost` depends on besides its range and the memory ceiling."""
        return self._range_kinds[virtual_stage]

    def least_range_cost(
        self, virtual_stage: int, start: int, stop: int
    ) -> tuple[float, float, float, float, float] | None:
        """`range_cost` whatever the memory ceiling (None: the range alone fits the memory limit at no level)."""
        found = self._kept_range_cost(virtual_stage, start, stop)
        return None if found is None else found[0]

    def _kept_range_cost(
        self, virtual_stage: int, start: int, stop: int
    ) -> tuple[tuple[float, float, float, float, float], float] | None:
        key = (self._range_kinds[virtual_stage], start, stop)
        values = self.range_costs.values
        if key not in values:
            values[key] = self._range_cost(virtual_stage, start, stop)
        return values[key]

    def _range_cost(
        self, virtual_stage: int, start: int, stop: int
    ) -> tuple[tuple[float, float, float, float, float], float] | None:
        stage, chunk = self.located[virtual_stage]
        params = self.param_bytes(start, stop)
        ranges: list[tuple[int, int] | None] = [None] * self.chunks
        ranges[chunk] = (start, stop)
        found = self._level_and_memory(stage, params, ranges)
        if found is None:
            return None
        level, memory = found
        forward, backward = self.forward_s(stage, start, stop), self.backward_s(stage, start, stop, level)
        frozen = self.frozen_bytes(start, stop)
        tail = self.tail_s(stage, params, stop - start, forward + backward, frozen) if self.chunks == 1 else 0.0
        weight = self.weight_s(stage, start, stop)
        return (forward, backward - weight, self.send_s(virtual_stage, stop), tail, weight), memory

    def bounds_of(self, counts: Sequence[int]) -> list[tuple[int, int]]:
        """Layer range [start, stop) of every virtual stage."""
        ranges, start = [], 0
        for count in counts:
            ranges.append((start, start + count))
            start += count
        return ranges

    def stage_levels(self, counts: Sequence[int]) -> list[tuple[int, float] | None]:
        """Per stage, for layers per virtual stage `counts`: its checkpointing level and memory at it, the memory
        ceiling aside (None: it fits the limit at no level)."""
        pp, ranges = self.layout.pp, self.bounds_of(counts)
        owned = [[ranges[k] for k in self.own[s]] for s in range(pp)]
        return [
            self._level_and_memory(s, sum(self.param_bytes(*own) for own in ranges), ranges)
            for s, ranges in enumerate(owned)
        ]

    def peak_bytes(self, counts: Sequence[int]) -> float:
        """The most memory a stage takes at its level, for layers per virtual stage `counts` that fit the limit."""
        return max(entry[1] for entry in self.stage_levels(counts) if entry is not None)

    def lower_ceiling(self, counts: Sequence[int], by: float) -> float:
        """Set the memory ceiling `by` bytes below the peak of layers per virtual stage `counts` (the least-memory
        pass, after a plan it found), and return it."""
        self.memory_ceiling = self.peak_bytes(counts) - by
        return self.memory_ceiling

    def step_s(self, counts: Sequence[int]) -> float | None:
        """The simulated step of layers per virtual stage `counts` (None: a stage exceeds the memory limit or
        ceiling)."""
        seconds = self.replay_seconds(counts)
        return None if seconds is None else self.replay.step_s(*seconds[:4], self.sharing, *seconds[4:])

    def replay_seconds(self, counts: Sequence[int]) -> tuple | None:
        """What `Replay.step_s` takes of layers per virtual stage `counts` besides the core sharing: forward,
        backward, send, tail, early, buffered and weight (None: a stage exceeds the memory limit or ceiling)."""
        pp = self.layout.pp
        found = self.stage_levels(counts)
        if any(entry is None or not self._under_ceiling(entry[1]) for entry in found):
            return None
        levels = [entry[0] for entry in found if entry is not None]
        ranges = self.bounds_of(counts)
        stage_of = [stage for stage, _ in self.located]
        forward = [self.forward_s(stage_of[v], a, b) + self.message_cpu_s(v) for v, (a, b) in enumerate(ranges)]
        backward = [
            self.backward_s(stage_of[v], a, b, levels[stage_of[v]]) + self.message_cpu_s(v, backward=True)
            for v, (a, b) in enumerate(ranges)
        ]
        send = [self.send_s(v, b) for v, (_, b) in enumerate(ranges)]
        tails = []
        for s in range(pp):
            own = self.own[s]
            params = sum(self.param_bytes(*ranges[k]) for k in own)
            frozen = sum(self.frozen_bytes(*ranges[k]) for k in own)
            layers = sum(b - a for a, b in (ranges[k] for k in own))
            tails.append(self.tail_s(s, params, layers, sum(forward[k] + backward[k] for k in own), frozen))
        early = [self.early_s(v, b) for v, (_, b) in enumerate(ranges)]
        weight = [self.weight_s(stage_of[v], a, b) for v, (a, b) in enumerate(ranges)] if self.splits else None
        return forward, backward, send, tails, early, self.buffered, weight

    def stage_plans(self, counts: Sequence[int]) -> list[StagePlan]:
        """Exact per-chunk seconds, transfers, syncs and memory for layers per virtual stage `counts`."""
        pp, dp = self.layout.pp, self.layout.dp
        ranges, most = self.bounds_of(counts), len(self.checkpointing) - 1  # a stage that fits nowhere: its least
        levels = [most if entry is None else entry[0] for entry in self.stage_levels(counts)]
        plans = []
        for s, group in enumerate(self.layout.stages):
            level = levels[s]
            virtual = self.own[s]
            own = tuple(ranges[k] for k in virtual)
            placed = list(zip(virtual, own, strict=True))
            outs = [(k, b) for k, (_, b) in placed]  # sends
            link, dp_link = self.hardware.send_links[s], self.hardware.dp_links[s]
            forward = tuple(self.forward_s(s, a, b) + self.message_cpu_s(k) for k, (a, b) in placed)
            backward = tuple(
                self.backward_s(s, a, b, level) + self.message_cpu_s(k, backward=True) for k, (a, b) in placed
            )
            params = sum(self.param_bytes(a, b) for a, b in own)
            frozen = sum(self.frozen_bytes(a, b) for a, b in own)
            layers = sum(b - a for a, b in own)
            plans.append(
                StagePlan(
                    index=s,
                    ranks=group.ranks,
                    chunks=own,
                    clusters=group.clusters,
                    nics=group.nics,
                    dp_link=dp_link.kind,
                    dp_gbps=dp_link.gbps if dp > 1 else 0.0,
                    device_tflops=self.hardware.tflops[s],
                    forward_s=forward,
                    backward_s=backward,
                    weight_s=tuple(self.weight_s(s, a, b) for a, b in own) if self.splits else (),
                    send_s=tuple(self.send_s(k, b) for k, b in outs),
                    early_s=tuple(self.early_s(k, b) for k, b in outs),
                    send_link=link.kind if pp > 1 else None,
                    send_gbps=link.gbps if pp > 1 else 0.0,
                    sync_s=self.sync_s(s, params, layers, frozen),
                    exposed_sync_s=self.exposed_sync_s(s, params, layers, sum(forward) + sum(backward), frozen),
                    update_s=self.update_s(params, layers, frozen),
                    closing_s=self.closing_s,
                    memory_gb=self.memory_bytes(s, params, own, level) / GB,
                    checkpointing=self.checkpointing[level],
                )
            )
        return plans

    def predict(self, stages: list[StagePlan]) -> StepPrediction:
        m, size, cost = self.microbatches, self.microbatch_size, self.cost
        return predict_step(
            stages,
            schedule=self.schedule,
            microbatches=m,
            microbatch_size=size,
            profile=cost.profile,
            shared_cores=cost.machine.shared_cores,
            backend=cost.backend,
        )


def predict_step(
    stages: Sequence[StagePlan],
    *,
    schedule: Schedule,
    microbatches: int,
    microbatch_size: int,
    profile: ModelProfile,
    shared_cores: float | None,
    backend: Backend,
) -> StepPrediction:
    """Simulate the step and split the stage that finishes last into compute, sync, transfers and bubble."""
    m, dp = microbatches, len(stages[0].ranks)
    timeline = simulate(stages, schedule, m, shared_cores=shared_cores, backend=backend)
    silent = [replace(s, send_s=tuple(0.0 for _ in s.send_s), early_s=()) for s in stages]
    no_transfers = simulate(silent, schedule, m, shared_cores=shared_cores, backend=backend)
    total = timeline.total_s
    last = max(range(len(stages)), key=lambda s: timeline.stage_end_s[s])
    compute = sum(b.end - b.start for b in timeline.stage_blocks(last) if b.kind in ("forward", "backward", "weight"))
    sync, update = stages[last].exposed_sync_s + stages[last].closing_s, stages[last].update_s
    p2p = max(min(total - no_transfers.total_s, total - compute - sync - update), 0.0)
    samples = m * microbatch_size * dp
    world = len(stages) * dp
    per_s = 1 / total if total > 0 else 0.0  # a profile without costs predicts nothing
    return StepPrediction(
        total_s=total,
        compute_s=compute,
        dp_sync_s=sync,
        p2p_s=p2p,
        optimizer_s=update,
        bubble_s=max(total - compute - sync - p2p - update, 0.0),
        tokens_per_s=samples * profile.tokens_per_sample * per_s,
        tflops_per_device=profile.flops_per_sample * samples * per_s / world / 1e12,
        memory_gb=max(s.memory_gb for s in stages),
    )


def _cumulative(values: list[float]) -> list[float]:
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return sums
