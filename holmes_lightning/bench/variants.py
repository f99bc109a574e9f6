"""The benchmark's runs: what each one trains with, on which emulated network, and the plan the planner predicts."""

from __future__ import annotations

from dataclasses import dataclass, replace

from holmes_lightning.bench.calibrate import Calibration, lab_topology, with_slow_cluster
from holmes_lightning.bench.config import BenchSettings
from holmes_lightning.planner import BatchSettings, ModelProfile, Plan, PlanOptions, Sharding, compare, plan
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
    "memory_fsdp": "Holmes FSDP, built on meta",
    "memory_replicas": "Holmes replicas, built on meta",
    "memory_eager": "Holmes replicas, built whole on every rank",
}


@dataclass(frozen=True)
class Variant:
    """One run: `strategy` is "holmes" (runs `plan`), "fsdp" or "ddp" (Lightning's own); `plan` also predicts."""

    name: str
    strategy: str
    topology: Topology
    plan: Plan

    @property
    def label(self) -> str:
        return LABELS[self.name]


@dataclass(frozen=True)
class Hardware:
    """The three emulated networks and the cost model's view of each (calibrated rank costs, scaled links)."""

    hybrid: Topology
    homogeneous: Topology
    unequal: Topology
    calibration: Calibration

    @classmethod
    def derive(cls, hybrid: Topology, settings: BenchSettings, calibration: Calibration) -> Hardware:
        unequal = with_slow_cluster(hybrid, settings.slow_cluster, settings.slow_nic_gbps)
        return cls(hybrid, hybrid.homogeneous(), unequal, calibration)

    def lab(self, topology: Topology) -> Topology:
        return lab_topology(topology, self.calibration.bandwidth_scale, self.calibration.device_tflops)


def plan_variants(
    hardware: Hardware, profile: ModelProfile, settings: BenchSettings, requested: PlanOptions
) -> list[Variant]:
    """Every requested variant with the plan the planner makes for it on the calibrated lab hardware."""
    batch = BatchSettings(settings.global_batch)
    options = hardware.calibration.plan_options(replace(requested, backend="gloo"))
    hybrid = compare(hardware.lab(hardware.hybrid), profile, batch, options)
    flat_fsdp = plan(
        hardware.lab(hardware.hybrid),
        profile,
        batch,
        replace(options, layout="flat_fsdp", sharding=Sharding.fsdp, pp=None),
    )
    unequal = compare(hardware.lab(hardware.unequal), profile, batch, options)
    ddp = plan(
        hardware.lab(hardware.hybrid),
        profile,
        batch,
        replace(options, layout="flat_fsdp", sharding=Sharding.none, pp=None),
    )
    runs = {
        "holmes_hybrid": ("holmes", hardware.hybrid, hybrid["holmes"]),
        "holmes_homogeneous": ("holmes", hardware.homogeneous, hybrid["homogeneous"]),
        "fsdp": ("fsdp", hardware.hybrid, flat_fsdp),
        "ddp": ("ddp", hardware.hybrid, ddp),
        "nic_unaware": ("holmes", hardware.hybrid, hybrid["nic_unaware"]),
        "holmes_unequal": ("holmes", hardware.unequal, unequal["holmes"]),
        "uniform_unequal": ("holmes", hardware.unequal, unequal["uniform"]),
    }
    return [Variant(name, *runs[name]) for name in settings.variants]
