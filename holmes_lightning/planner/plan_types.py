"""The `Plan`: what the planner decides and the runtime executes (plain data, JSON round-trip)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: its data-parallel/sharding group (ranks in dp order) and the model chunks it owns.

    `chunks` are half-open layer ranges [start, stop) into the profile's layer list; one chunk for GPipe/1F1B,
    several for interleaved schedules (chunk j of stage s is virtual stage s + j * pp). Per chunk and micro-batch:
    `forward_s`/`backward_s` compute seconds and `send_s` the transfer of its output to the next virtual stage over
    `send_link` (0 for the last). `sync_s` is the stage's DP gradient sync per step over `dp_link`, `exposed_sync_s`
    the part backward does not hide, `update_s` the optimizer step after it; `memory_gb` the estimated peak per device.
    """

    index: int
    ranks: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]
    cluster: str
    nic: str
    dp_link: str = "intra_node"
    dp_gbps: float = 0.0
    device_tflops: float = 0.0
    forward_s: tuple[float, ...] = ()
    backward_s: tuple[float, ...] = ()
    send_s: tuple[float, ...] = ()
    send_link: str = ""
    send_gbps: float = 0.0
    sync_s: float = 0.0
    exposed_sync_s: float = 0.0
    update_s: float = 0.0
    memory_gb: float = 0.0

    @property
    def layers(self) -> list[int]:
        return [i for start, stop in self.chunks for i in range(start, stop)]


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
    """A rank layout, a partition and a schedule, with the step time the cost model predicts for them."""

    layout: str
    schedule: str
    stages: tuple[StagePlan, ...]
    microbatches: int
    microbatch_size: int
    prediction: StepPrediction
    num_layers: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    partition: str = "auto"
    sharding: str = "fsdp"
    tokens_per_sample: int = 0

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
        data = json.loads(text)
        stages = tuple(StagePlan(**{key: _tuples(value) for key, value in s.items()}) for s in data.pop("stages"))
        prediction = StepPrediction(**data.pop("prediction"))
        return cls(stages=stages, prediction=prediction, notes=tuple(data.pop("notes", ())), **data)

    def layers_per_stage(self) -> list[int]:
        return [len(stage.layers) for stage in self.stages]

    def speedup_over(self, other: Plan) -> float:
        """How many times faster this plan's predicted step is than `other`'s."""
        return other.prediction.total_s / self.prediction.total_s


def _tuples(value: object) -> object:
    """JSON lists back to the tuples the dataclasses hold (nested for `chunks`)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
