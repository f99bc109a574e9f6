"""The cost model's hardware for the lab: a rank's costs measured in one process, links x the lab's scale.

A lab rank is one CPU thread. Its costs are measured on the benchmark's model
(`holmes_lightning.measure.calibration`, the same measurement HolmesStrategy makes at job start, cached per machine
and model shape): speed per sample, fixed cost per pass, AdamW step, FSDP2's hooks, and the latency of a message
between the job's ranks while all compute (ranks started here for it, on loopback). Every lab rank computes on this
machine's cores: the cost model gets a rank's speed alone and the core count, and times each action at the speed the
ranks computing beside it leave it (`planner.sharing`). Links run at their configured speed x the lab's bandwidth
scale, as the lab shapes them, and every byte they move costs the cores what it cost in the lab (veth, bridge and tc
between namespaces: about 6 CPU-s per GB here, ten times loopback's), measured there once per machine.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from holmes_lightning.bench.model import BenchModel
from holmes_lightning.lab.design import MAX_LAB_MBIT
from holmes_lightning.lab.run import run_in_lab
from holmes_lightning.lab.scale import default_bandwidth_scale, fastest_link_gbps
from holmes_lightning.measure import available_cores, calibration, together
from holmes_lightning.measure.calibration import Calibration
from holmes_lightning.planner import MachineCosts, ModelProfile
from holmes_lightning.topology import Topology


@dataclass(frozen=True)
class LabCalibration:
    """A lab rank's calibrated costs, and the scale the lab runs every link at (`scale_reason`: where it came from)."""

    calibration: Calibration
    bandwidth_scale: float
    scale_reason: str

    def at_scale(self, bandwidth_scale: float, reason: str) -> LabCalibration:
        return replace(self, bandwidth_scale=bandwidth_scale, scale_reason=reason)

    def describe(self) -> str:
        return f"{self.calibration.describe()}; bandwidth_scale={self.bandwidth_scale:.3g} ({self.scale_reason})"

    def record(self) -> dict:
        """Every number in one flat dict (the benches' JSON)."""
        return {**self.calibration.record(), "bandwidth_scale": self.bandwidth_scale, "scale_reason": self.scale_reason}


def calibrate(
    hybrid: Topology,
    profile: ModelProfile,
    model: BenchModel,
    *,
    seconds: float,
    scale: float | None,
    assumed: MachineCosts,
    fresh: bool = False,
) -> LabCalibration:
    """A lab rank of `hybrid` training `model`, each distinct layer timed for `seconds`; `scale` None: the lab's
    default bandwidth scale for this CPU; `assumed`: the costs not measured (e.g. `dp_overlap`); `fresh`: time the
    model even if its costs are cached."""
    layers = model.build().pipeline_layers()
    measured = calibration.measure(layers, model.sample(), device=torch.device("cpu"), seconds=seconds, fresh=fresh)
    latency = together.local_handoff_latency_s(hybrid.world_size)
    scale, reason = (scale, "bench.bandwidth_scale") if scale is not None else default_bandwidth_scale(hybrid)
    costs = Calibration.of(
        measured,
        profile,
        share=1.0,
        assumed=replace(assumed, shared_cores=available_cores()),
        latency_s=latency,
        transfer_cpu_s_per_byte=lab_transfer_cpu_s_per_byte(hybrid),
    )
    return LabCalibration(costs, scale, reason)


def lab_transfer_cpu_s_per_byte(hybrid: Topology) -> float:
    """What the lab's links cost this machine's cores per byte moved: `together.transfer_cpu_s_per_byte` run by
    `hybrid`'s ranks in the lab, links at half the fastest rate it shapes exactly; cached per machine and rank count."""
    scale = MAX_LAB_MBIT / 1000 / fastest_link_gbps(hybrid) / 2
    code = (
        "import sys, torch.distributed as dist; "
        "from holmes_lightning.measure.together import transfer_cpu_s_per_byte; "
        "dist.init_process_group('gloo'); cost = transfer_cpu_s_per_byte(); "
        "dist.get_rank() or open(sys.argv[1], 'w').write(repr(cost)); dist.destroy_process_group()"
    )

    def measure() -> float:
        with tempfile.TemporaryDirectory() as folder:
            result = Path(folder) / "cpu_s_per_byte"
            if run_in_lab(hybrid, [sys.executable, "-c", code, str(result)], bandwidth_scale=scale).code:
                raise RuntimeError("measuring what the lab's links cost the cores failed; the ranks' output is above")
            return float(result.read_text())

    return together.cached_measurement(
        "lab-transfer", [hybrid.world_size, together.TRANSFER_BYTES, together.TRANSFER_ROUNDS], measure
    )


def lab_topology(topology: Topology, bandwidth_scale: float, device_tflops: float) -> Topology:
    """The topology as the lab runs it, configured so (the bench plans its alternatives, the homogeneous limit among
    them, on it): every device at `device_tflops`, every link's speed x `bandwidth_scale`."""
    spec = topology.spec
    clusters = [
        replace(group, nic=replace(group.nic, gbps=group.nic.gbps * bandwidth_scale), device_tflops=None)
        for group in spec.clusters
    ]
    scaled = replace(
        spec,
        name=f"{spec.name}_lab",
        clusters=clusters,
        device_tflops=device_tflops,
        intra_node=replace(spec.intra_node, gbps=spec.intra_node.gbps * bandwidth_scale),
        inter_cluster=spec.inter_cluster.scaled(bandwidth_scale),
    )
    return Topology(scaled)


def with_slow_cluster(topology: Topology, cluster: str, nic_gbps: float) -> Topology:
    """The same machines with one cluster's NIC at `nic_gbps`: clusters that differ in speed."""
    names = [group.name for group in topology.spec.clusters]
    if cluster not in names:
        raise ValueError(f"bench.slow_cluster={cluster!r}: cluster {topology.name!r} has clusters {names}")
    clusters = [
        replace(group, nic=replace(group.nic, gbps=nic_gbps)) if group.name == cluster else group
        for group in topology.spec.clusters
    ]
    return Topology(replace(topology.spec, name=f"{topology.name}_slow_{cluster}", clusters=clusters))
