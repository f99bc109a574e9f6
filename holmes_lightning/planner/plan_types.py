"""The `Plan`: what the planner decides and the runtime executes (plain data, JSON round-trip)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from holmes_lightning.planner.options import Backend, Checkpointing, LayoutKind, Schedule, Sharding
from holmes_lightning.planner.schedules import microbatch_problem
from holmes_lightning.topology import LinkKind, NICKind

PLAN_VERSION = 2  # 2: typed stage facts (clusters, nics, link kinds), `rdma` and `pp_links`


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: its data-parallel/sharding group (ranks in dp order) and the model chunks it owns.

    `chunks` are half-open layer ranges [start, stop) into the profile's layer list; one chunk for GPipe/1F1B,
    several for interleaved and V schedules (chunk j of stage s is virtual stage `virtual_stage(s, j, pp)`). Per chunk
    and micro-batch:
    `forward_s`/`backward_s` compute seconds (`weight_s`: of the backward, the weight-gradient pass a zero-bubble
    schedule runs apart; empty: none) and `send_s` the transfer of its output to the next virtual stage over
    `send_link` (0 for the last; no link without a pipeline), `early_s` the part of it that may cross before the
    receiver posts its recv (gloo; empty: none). `clusters` / `nics`: what the DP group spans, one of
    each in a Holmes layout, several in a NIC-unaware one. `sync_s` is the stage's DP gradient sync per step over
    `dp_link`, `exposed_sync_s` the part the computation does not hide, `closing_s` a pipelined step's all-reduce of
    the loss over every rank after it, `update_s` the optimizer step after that; `memory_gb` the estimated peak per
    device; `checkpointing` which of its layers keep only their input (`Checkpointing.recomputed`).
    """

    index: int
    ranks: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]
    clusters: tuple[str, ...]
    nics: tuple[NICKind, ...]
    dp_link: LinkKind = LinkKind.INTRA_NODE
    dp_gbps: float = 0.0
    device_tflops: float = 0.0
    forward_s: tuple[float, ...] = ()
    backward_s: tuple[float, ...] = ()
    weight_s: tuple[float, ...] = ()
    send_s: tuple[float, ...] = ()
    early_s: tuple[float, ...] = ()
    send_link: LinkKind | None = None
    send_gbps: float = 0.0
    sync_s: float = 0.0
    exposed_sync_s: float = 0.0
    closing_s: float = 0.0
    update_s: float = 0.0
    memory_gb: float = 0.0
    checkpointing: Checkpointing = Checkpointing.off

    @property
    def layers(self) -> list[int]:
        return [i for start, stop in self.chunks for i in range(start, stop)]

    @property
    def mixes_fabrics(self) -> bool:
        """The DP group spans clusters or NIC kinds (only a NIC-unaware layout does that)."""
        return len(self.clusters) > 1 or len(self.nics) > 1


@dataclass(frozen=True)
class StepPrediction:
    """Predicted seconds per optimizer step and where they go, for the stage that finishes last.

    compute + dp_sync + p2p + optimizer + bubble = total: `p2p_s` is what transfers add to the step, `optimizer_s`
    the optimizer step after the sync, `bubble_s` the rest of that stage's idle time. `tflops_per_device` counts
    model FLOPs (forward + backward, no recomputation).
    """

    total_s: float
    compute_s: float
    dp_sync_s: float
    p2p_s: float
    bubble_s: float
    optimizer_s: float = 0.0
    tokens_per_s: float = 0.0
    tflops_per_device: float = 0.0
    memory_gb: float = 0.0


@dataclass(frozen=True)
class Plan:
    """A rank layout, a partition and a schedule, with the step time the cost model predicts for them.

    `sharding` is the resolved choice (fsdp or none). `rdma`: the job's communicators use their RDMA fabrics (False:
    every one runs on TCP sockets, as a NIC-unaware job holding IB and RoCE must). `pp_links[d]` is the slowest link
    of DP column d's pipeline group (the ranks with dp index d, one per stage); each stage's own group is `dp_link`.
    `shared_cores`: the ranks were planned as sharing this many CPU cores (`planner.sharing`; None: a device each);
    `backend`: the collective library it was planned for.
    """

    layout: LayoutKind
    schedule: Schedule
    stages: tuple[StagePlan, ...]
    microbatches: int
    microbatch_size: int
    prediction: StepPrediction
    num_layers: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    partition: str = "auto"
    sharding: Sharding = Sharding.fsdp
    tokens_per_sample: int = 0
    rdma: bool = True
    pp_links: tuple[LinkKind, ...] = ()
    shared_cores: float | None = None
    backend: Backend = Backend.nccl
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        schedule = Schedule(self.schedule)  # a plan written by hand may name it as a string
        if schedule.chosen:
            raise ValueError("a Plan runs one schedule, not schedule='auto'; plan with auto to have one chosen")
        object.__setattr__(self, "schedule", schedule)

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def dp(self) -> int:
        return len(self.stages[0].ranks)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def global_batch(self) -> int:
        return self.microbatches * self.microbatch_size * self.dp

    @property
    def replica_batch(self) -> int:
        """Samples per step of one DP replica (what its DataLoader yields): micro-batches x micro-batch size."""
        return self.microbatches * self.microbatch_size

    def microbatch_counts(self, samples: int) -> list[int]:
        """The counts of equal micro-batches a replica batch of `samples` may run in, best first: the plan's where they
        split it, then from the fewest of at most `microbatch_size` samples each up to one sample each (a shorter
        batch, such as an epoch's last, stays within the memory planned for a micro-batch)."""
        fewest = -(-samples // self.microbatch_size)
        counts = [count for count in range(fewest, samples + 1) if samples % count == 0]
        return [self.microbatches, *counts] if samples % self.microbatches == 0 else counts

    def training_microbatches(self, samples: int) -> int:
        """The micro-batches a training batch of `samples` per replica runs in: the first of `microbatch_counts` the
        schedule takes (1F1B wants at least pp, ...), else the first (run by a schedule that takes any count)."""
        counts = self.microbatch_counts(samples)
        return next((count for count in counts if microbatch_problem(self.schedule, self.pp, count) is None), counts[0])

    @property
    def is_fsdp(self) -> bool:
        return self.sharding is Sharding.fsdp

    @property
    def is_pipelined(self) -> bool:
        """More than one virtual stage: a schedule runs the step (also pp=1 with two chunks on one rank)."""
        return self.num_virtual_stages > 1

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP frees gathered weights after forward only without a pipeline (`reshards_after_forward`)."""
        return reshards_after_forward(pipelined=self.is_pipelined)

    @property
    def chunks_per_stage(self) -> int:
        return len(self.stages[0].chunks)

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * self.chunks_per_stage

    def virtual_stages(self, stage: int) -> tuple[int, ...]:
        """The virtual pipeline stages `stage` runs, one per chunk, in its schedule's placement (`virtual_stage`)."""
        return tuple(virtual_stages(stage, self.chunks_per_stage, self.pp, v_shaped=self.schedule.v_shaped))

    def holds_first(self, stage: int) -> bool:
        """`stage` runs virtual stage 0: it feeds the inputs."""
        return 0 in self.virtual_stages(stage)

    def holds_last(self, stage: int) -> bool:
        """`stage` runs the last virtual stage: it computes the loss."""
        return self.num_virtual_stages - 1 in self.virtual_stages(stage)

    def mesh_layout(self) -> list[list[int]]:
        """Ranks as a (pp, dp) grid, row s = stage s's DP group: the layout of the ("pp", "dp") DeviceMesh."""
        return [list(stage.ranks) for stage in self.stages]

    def coordinate(self, rank: int) -> tuple[int, int]:
        """(stage index, dp index) of a global rank."""
        for stage in self.stages:
            if rank in stage.ranks:
                return stage.index, stage.ranks.index(rank)
        raise KeyError(f"rank {rank} is not in this plan ({self.world_size} ranks)")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """A plan written by `to_json`, of this version or version 1 (which has no `rdma` / `pp_links`)."""
        data = json.loads(text)
        version = data.pop("version", 1)
        stages = tuple(_stage_from_json(stage, version) for stage in data.pop("stages"))
        prediction = StepPrediction(**data.pop("prediction"))
        known = {f.name for f in fields(cls)}
        data = {key: value for key, value in data.items() if key in known}
        data["layout"] = LayoutKind(data["layout"])
        data["backend"] = Backend(data.get("backend", Backend.nccl))
        data["sharding"] = Sharding(data.get("sharding", Sharding.fsdp))
        data["pp_links"] = tuple(LinkKind(kind) for kind in data.get("pp_links", ()))
        data["notes"] = tuple(data.get("notes", ()))
        return cls(stages=stages, prediction=prediction, version=version, **data)

    def layers_per_stage(self) -> list[int]:
        return [len(stage.layers) for stage in self.stages]

    def speedup_over(self, other: Plan) -> float:
        """How many times faster this plan's predicted step is than `other`'s."""
        return other.prediction.total_s / self.prediction.total_s


def reshards_after_forward(*, pipelined: bool) -> bool:
    """The runtime's FSDP policy (torchtitan's default): free gathered weights after forward only without a pipeline.

    Pipelined, the weights stay gathered from forward to backward: re-gathering per micro-batch costs an all-gather
    each, and resharding gives the zero-bubble schedules wrong gradients (GUIDE section 6). Without a pipeline a step
    gathers twice, for forward and again for backward.
    """
    return not pipelined


def virtual_stage(stage: int, chunk: int, pp: int, *, v_shaped: bool = False) -> int:
    """The virtual stage that chunk `chunk` of `stage` runs: in loop placement `stage + chunk * pp` (interleaved
    schedules), in V placement (`Schedule.v_shaped`, two chunks) `stage`, then `2 * pp - 1 - stage`."""
    if v_shaped and chunk % 2:
        return (chunk + 1) * pp - 1 - stage
    return stage + chunk * pp


def virtual_stages(stage: int, chunks: int, pp: int, *, v_shaped: bool = False) -> list[int]:
    """The virtual stages `stage` runs, chunk by chunk (`virtual_stage`)."""
    return [virtual_stage(stage, chunk, pp, v_shaped=v_shaped) for chunk in range(chunks)]


def locate_virtual(virtual: int, pp: int, *, v_shaped: bool = False) -> tuple[int, int]:
    """(stage, chunk) that runs virtual stage `virtual`: the inverse of `virtual_stage`."""
    chunk, stage = divmod(virtual, pp)
    if v_shaped and chunk % 2:
        return pp - 1 - stage, chunk
    return stage, chunk


def _stage_from_json(data: dict[str, Any], version: int) -> StagePlan:
    data = {key: _tuples(value) for key, value in data.items()}
    if version == 1:  # one "+"-joined name per DP group; no send link written as ""
        data["clusters"] = tuple(data.pop("cluster").split("+"))
        data["nics"] = tuple(data.pop("nic").split("+"))
        data["send_link"] = data.get("send_link") or None
    data["nics"] = tuple(NICKind(nic) for nic in data["nics"])
    data["dp_link"] = LinkKind(data.get("dp_link", LinkKind.INTRA_NODE))
    data["send_link"] = None if data.get("send_link") is None else LinkKind(data["send_link"])
    data["checkpointing"] = Checkpointing(data.get("checkpointing", Checkpointing.off))
    return StagePlan(**data)


def _tuples(value: object) -> object:
    """JSON lists back to the tuples the dataclasses hold (nested for `chunks`)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
