"""One candidate plan, a layout at one micro-batch count: stage costs for the partition, then exact stage plans."""

from __future__ import annotations

from dataclasses import dataclass, replace

from holmes_lightning.planner.cost import CostModel
from holmes_lightning.planner.layout import Layout, boundary_link
from holmes_lightning.planner.partition import StageCost
from holmes_lightning.planner.plan_types import StagePlan, StepPrediction, virtual_stage
from holmes_lightning.planner.schedules import peak_stash, stage_actions
from holmes_lightning.planner.simulate import simulate

GB = 1e9


@dataclass
class Candidate:
    """Seconds and bytes of any layer range on any stage of `layout` (prefix sums: two lookups per range)."""

    layout: Layout
    cost: CostModel
    schedule: str
    chunks: int
    microbatches: int
    microbatch_size: int

    def __post_init__(self) -> None:
        topology, layers = self.cost.topology, self.cost.profile.layers
        self.speeds = [min(topology.device_tflops(r) for r in stage.ranks) for stage in self.layout.stages]
        seconds = {speed: self.cost.microbatch_seconds(speed, self.microbatch_size) for speed in set(self.speeds)}
        self.seconds = [seconds[speed] for speed in self.speeds]
        stages = self.layout.stages
        self.dp_links = [self.cost.dp_link(stage.ranks) for stage in stages]
        following = stages[1:] + stages[:1]
        pairs = zip(stages, following, strict=True)
        self.send_links = [boundary_link(topology, a, b, self.cost.rdma) for a, b in pairs]
        self.orders = [
            stage_actions(self.schedule, s, self.layout.pp, self.microbatches, self.chunks) for s in range(len(stages))
        ]
        self._sums = {
            "forward": [_cumulative(fwd) for fwd, _ in self.seconds],
            "backward": [_cumulative(bwd) for _, bwd in self.seconds],
            "params": [_cumulative([layer.param_bytes for layer in layers])],
            "stash": [_cumulative([layer.stash_bytes for layer in layers])],
        }

    def _range(self, name: str, start: int, stop: int, stage: int = 0) -> float:
        sums = self._sums[name][stage]
        return sums[stop] - sums[start]

    def stage_cost(self, stage: int, start: int, stop: int, memory_limit: float | None) -> StageCost | None:
        """Stage `stage` holding layers [start, stop) as one contiguous load (None: above the memory limit)."""
        mb, layout, cost = self.microbatch_size, self.layout, self.cost
        backward = self._range("backward", start, stop, stage)
        compute = self._range("forward", start, stop, stage) + backward
        send = 0.0
        if stage < layout.pp - 1:
            send = cost.profile.layers[stop - 1].activation_bytes * mb / self.send_links[stage].bytes_per_s
        params = self._range("params", start, stop)
        sync = cost.dp_sync_s(layout.dp, self.dp_links[stage], params)
        if memory_limit is not None:
            in_flight = peak_stash(self.orders[stage], [1.0] * self.chunks)
            stash = in_flight * self._range("stash", start, stop) * mb / self.chunks
            pipelined = layout.pp * self.chunks > 1
            if cost.memory_bytes(params, dp=layout.dp, stash_bytes=stash, pipelined=pipelined) > memory_limit:
                return None
        return StageCost(compute, send, cost.exposed_sync_s(sync, backward) + cost.update_s(params, layout.dp))

    def stage_plans(self, counts: tuple[int, ...]) -> list[StagePlan]:
        """Exact per-chunk seconds, transfers, syncs and memory for layers per virtual stage `counts`."""
        pp, mb, cost = self.layout.pp, self.microbatch_size, self.cost
        layers = cost.profile.layers
        bounds = [0]
        for count in counts:
            bounds.append(bounds[-1] + count)
        last_virtual = pp * self.chunks - 1
        plans = []
        for s, group in enumerate(self.layout.stages):
            virtual = [virtual_stage(s, j, pp) for j in range(self.chunks)]
            ranges = tuple((bounds[k], bounds[k + 1]) for k in virtual)
            fwd, bwd = self.seconds[s]
            link, dp_link = self.send_links[s], self.dp_links[s]
            backward = tuple(sum(bwd[a:b]) for a, b in ranges)
            sends = tuple(
                0.0 if k == last_virtual else layers[b - 1].activation_bytes * mb / link.bytes_per_s
                for k, (_, b) in zip(virtual, ranges, strict=True)
            )
            params = sum(self._range("params", a, b) for a, b in ranges)
            sync = cost.dp_sync_s(self.layout.dp, dp_link, params)
            peak = peak_stash(self.orders[s], [self._range("stash", a, b) * mb for a, b in ranges])
            plans.append(
                StagePlan(
                    index=s,
                    ranks=group.ranks,
                    chunks=ranges,
                    clusters=group.clusters,
                    nics=group.nics,
                    dp_link=dp_link.kind,
                    dp_gbps=dp_link.gbps if self.layout.dp > 1 else 0.0,
                    device_tflops=self.speeds[s],
                    forward_s=tuple(sum(fwd[a:b]) for a, b in ranges),
                    backward_s=backward,
                    send_s=sends,
                    send_link=link.kind if pp > 1 else None,
                    send_gbps=link.gbps if pp > 1 else 0.0,
                    sync_s=sync,
                    exposed_sync_s=cost.exposed_sync_s(sync, sum(backward)),
                    update_s=cost.update_s(params, self.layout.dp),
                    memory_gb=cost.memory_bytes(
                        params, dp=self.layout.dp, stash_bytes=peak, pipelined=pp * self.chunks > 1
                    )
                    / GB,
                )
            )
        return plans

    def predict(self, stages: list[StagePlan]) -> StepPrediction:
        """Simulate the step and split the stage that finishes last into compute, sync, transfers and bubble."""
        m, profile = self.microbatches, self.cost.profile
        timeline = simulate(stages, self.schedule, m)
        no_transfers = simulate([replace(s, send_s=tuple(0.0 for _ in s.send_s)) for s in stages], self.schedule, m)
        total = timeline.total_s
        last = max(range(len(stages)), key=lambda s: timeline.stage_end_s[s])
        compute = m * (sum(stages[last].forward_s) + sum(stages[last].backward_s))
        sync, update = stages[last].exposed_sync_s, stages[last].update_s
        p2p = max(min(total - no_transfers.total_s, total - compute - sync - update), 0.0)
        samples = m * self.microbatch_size * self.layout.dp
        world = self.layout.pp * self.layout.dp
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
