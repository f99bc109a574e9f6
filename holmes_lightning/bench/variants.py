"""The benchmark's runs: what each one trains with, on which emulated network, and the plan the planner predicts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from holmes_lightning.bench.calibrate import LabCalibration, lab_topology, with_slow_cluster
from holmes_lightning.bench.config import FREE_CHOICE, BenchSettings
from holmes_lightning.measure.calibration import Calibration
from holmes_lightning.planner import (
    Backend,
    BatchSettings,
    LayoutKind,
    MachineCosts,
    ModelProfile,
    PartitionRule,
    Plan,
    PlanError,
    PlanOptions,
    Schedule,
    Sharding,
    best_plan,
    compare_plans,
    on_shared_cores,
)
from holmes_lightning.topology import Topology

REFERENCE = "holmes_hybrid"
LABELS = {
    "holmes_hybrid": "Holmes, hybrid NICs",
    "holmes_homogeneous": "Holmes, homogeneous limit",
    "fsdp": "Lightning FSDP2, flat (ModelParallelStrategy)",
    "ddp": "Lightning DDPStrategy",
    "nic_unaware": "pipeline x DP, NIC-unaware layout",
    "holmes_unequal": "Holmes auto partition, unequal clusters",
    "uniform_unequal": "Holmes uniform partition, unequal clusters",
    FREE_CHOICE: "Holmes, planner's free choice",
    "memory_fsdp": "Holmes FSDP, built on meta",
    "memory_replicas": "Holmes replicas, built on meta",
    "memory_eager": "Holmes replicas, built whole on every rank",
    "memory_fsdp_ac_off": "Holmes FSDP, no activation checkpointing",
    "memory_fsdp_ac_full": "Holmes FSDP, every layer checkpointed",
    "memory_fsdp_ac_selective": "Holmes FSDP, every other layer checkpointed",
}
HYBRID_RUNS = ("holmes_hybrid", "holmes_homogeneous", "nic_unaware", "fsdp", "ddp", FREE_CHOICE)
UNEQUAL_RUNS = ("holmes_unequal", "uniform_unequal")
LIGHTNING_STRATEGIES = ("fsdp", "ddp")  # runs of Lightning's own strategies; every other run is HolmesStrategy
SCHEDULE_RUN = "holmes_schedule_"  # and a schedule's name: Holmes with that schedule (`bench.schedules`)


@dataclass(frozen=True)
class Variant:
    """One run: `strategy` is "holmes" (runs `plan`), "fsdp" or "ddp" (Lightning's own); `plan` also predicts."""

    name: str
    strategy: str
    topology: Topology
    plan: Plan

    @property
    def label(self) -> str:
        if self.name.startswith(SCHEDULE_RUN):
            return f"Holmes, {self.plan.schedule.value}"
        return LABELS[self.name]


@dataclass(frozen=True)
class Hardware:
    """The three emulated networks and the cost model's view of each (calibrated rank costs, scaled links)."""

    hybrid: Topology
    homogeneous: Topology
    unequal: Topology
    calibration: LabCalibration

    @classmethod
    def derive(cls, hybrid: Topology, settings: BenchSettings, calibration: LabCalibration) -> Hardware:
        unequal = with_slow_cluster(hybrid, settings.slow_cluster, settings.slow_nic_gbps)
        return cls(hybrid, hybrid.homogeneous(), unequal, calibration)

    def lab(self, topology: Topology) -> Topology:
        measured = self.calibration
        return lab_topology(topology, measured.bandwidth_scale, measured.calibration.device_tflops)

    @property
    def costs(self) -> MachineCosts:
        """What a lab rank costs the cost model (compute as the lab topology's device speed)."""
        return self.calibration.calibration.costs


def on_gloo(requested: PlanOptions) -> PlanOptions:
    """What the planner plans the lab's runs with: `requested`, on gloo."""
    return replace(requested.settings(), backend=Backend.gloo)


def run_key(planned: Plan) -> tuple:
    """What the runtime runs: the ranks, layers and links of every stage, the schedule, micro-batches and sharding."""
    stages = tuple((stage.ranks, stage.chunks, stage.dp_link, stage.send_link) for stage in planned.stages)
    return (stages, planned.schedule, planned.microbatches, planned.sharding)


def free_choice(options: PlanOptions) -> PlanOptions:
    """`options` with nothing pinned that the planner chooses: degrees, partition, sharding."""
    return replace(options, pp=None, dp=None, partition=PartitionRule.auto, sharding=Sharding.auto)


def plan_alternatives(
    hybrid: Topology,
    profile: ModelProfile,
    batch: BatchSettings,
    *,
    options: PlanOptions,
    costs: MachineCosts,
    names: Sequence[str] = HYBRID_RUNS,
) -> dict[str, Plan]:
    """Holmes' plan for the hybrid cluster and the alternatives the bench runs on it (`names` of `HYBRID_RUNS`).

    The homogeneous limit and the NIC-unaware layout are `compare`'s; flat FSDP2 and DDP are one group over every
    rank, sharded or replicated; the free choice is Holmes with no degree, partition or sharding pinned.
    """
    plans: dict[str, Plan] = {}
    if set(names) & {"holmes_hybrid", "holmes_homogeneous", "nic_unaware", "fsdp"}:
        compared = compare_plans(hybrid, profile, batch, options=options, costs=costs)
        missing = [name for name in ("homogeneous", "nic_unaware", "flat_fsdp") if name not in compared]
        if missing:
            raise ValueError(f"bench: {'; '.join(compared['holmes'].notes)}")
        plans.update(
            holmes_hybrid=compared["holmes"],
            holmes_homogeneous=compared["homogeneous"],
            nic_unaware=compared["nic_unaware"],
            fsdp=compared["flat_fsdp"],
        )
    if "ddp" in names:
        replicas = replace(options, layout=LayoutKind.flat_fsdp, sharding=Sharding.none, pp=None)
        plans["ddp"] = best_plan(hybrid, profile, batch, options=replicas, costs=costs)
    if FREE_CHOICE in names:
        plans[FREE_CHOICE] = best_plan(hybrid, profile, batch, options=free_choice(options), costs=costs)
    return {name: plans[name] for name in names}


def plan_variants(
    hardware: Hardware, profile: ModelProfile, settings: BenchSettings, requested: PlanOptions
) -> list[Variant]:
    """Every requested variant with the plan the planner makes for it on the cluster the lab emulates (a device per
    rank, each at its share of this machine's cores), predicted as it runs here (the ranks share the cores)."""
    batch = BatchSettings(settings.global_batch)
    hardware, measured, devices = _per_device(hardware)
    options, costs = on_gloo(requested), hardware.costs
    hybrid_runs = [name for name in settings.variants if name in HYBRID_RUNS]
    plans = plan_alternatives(
        hardware.lab(hardware.hybrid), profile, batch, options=options, costs=costs, names=hybrid_runs
    )
    if set(settings.variants) & set(UNEQUAL_RUNS):
        unequal = compare_plans(hardware.lab(hardware.unequal), profile, batch, options=options, costs=costs)
        plans.update(holmes_unequal=unequal["holmes"], uniform_unequal=unequal["uniform"])
    networks = {"holmes_homogeneous": hardware.homogeneous, **dict.fromkeys(UNEQUAL_RUNS, hardware.unequal)}
    return [
        Variant(
            name=name,
            strategy=name if name in LIGHTNING_STRATEGIES else "holmes",
            topology=networks.get(name, hardware.hybrid),
            plan=_as_run_here(plans[name], profile, measured, devices),
        )
        for name in settings.variants
    ]


def plan_schedule_variants(
    hardware: Hardware, profile: ModelProfile, settings: BenchSettings, requested: PlanOptions
) -> tuple[list[Variant], dict[str, str]]:
    """Holmes on the hybrid cluster with each schedule of `settings.schedules` (None: no runs), the rest as
    `requested`, planned and predicted as `plan_variants` plans its runs; and per schedule the planner refused, why."""
    hardware, measured, devices = _per_device(hardware)
    batch, lab = BatchSettings(settings.global_batch), hardware.lab(hardware.hybrid)
    runs, refused = [], {}
    for schedule in map(Schedule, settings.schedules or ()):
        options = replace(on_gloo(requested), schedule=schedule)
        try:
            planned = best_plan(lab, profile, batch, options=options, costs=hardware.costs)
        except PlanError as error:
            refused[schedule.value] = str(error).splitlines()[-1].strip()
            continue
        here = _as_run_here(planned, profile, measured, devices)
        runs.append(Variant(SCHEDULE_RUN + schedule.value, "holmes", hardware.hybrid, here))
    return runs, refused


def _per_device(hardware: Hardware) -> tuple[Hardware, Calibration, Calibration]:
    """`hardware` with its calibration for a device per rank of the hybrid cluster; the calibration as measured (this
    machine's), and that per device."""
    measured = hardware.calibration.calibration
    devices = measured.as_devices(hardware.hybrid.world_size)
    return replace(hardware, calibration=replace(hardware.calibration, calibration=devices)), measured, devices


def _as_run_here(planned: Plan, profile: ModelProfile, measured: Calibration, devices: Calibration) -> Plan:
    """`planned` (for a device per rank) predicted with the ranks sharing this machine's cores, as the lab runs it."""
    cores = measured.costs.shared_cores
    if cores is None:
        return planned
    return on_shared_cores(
        planned,
        profile,
        cores=cores,
        share=devices.share / measured.share,
        transfer_cpu_s_per_byte=measured.transfer_cpu_s_per_byte,
    )
