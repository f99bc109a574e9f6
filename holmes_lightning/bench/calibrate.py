"""The cost model's hardware for the lab: a rank's costs measured in one process, links x the lab's scale.

A lab rank is one CPU thread. Its costs are measured on the benchmark's GPT (`holmes_lightning.calibration`, the
same measurement HolmesStrategy makes at job start, cached per machine and model shape): speed per sample, fixed cost
per pass, AdamW step, FSDP2's hooks, and the latency of a message between the job's ranks while all compute (ranks
started here for it, on loopback). Every lab rank computes on this machine's cores: the cost model gets a rank's
speed alone and the core count, and times each action at the speed the ranks computing beside it leave it
(`planner.sharing`). Links run at their configured speed x the lab's bandwidth scale, as the lab shapes them, and
every byte they move costs the cores what it cost in the lab (veth, bridge and tc between namespaces: about 6 CPU-s
per GB here, ten times loopback's), measured there once per machine.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from holmes_lightning import calibration
from holmes_lightning.calibration import Calibration
from holmes_lightning.config import ModelConfig
from holmes_lightning.lab.plan import MAX_LAB_MBIT
from holmes_lightning.lab.run import run_in_lab
from holmes_lightning.lab.scale import default_bandwidth_scale, fastest_link_gbps
from holmes_lightning.measure import available_cores, profile_modules
from holmes_lightning.planner import ModelProfile
from holmes_lightning.recipes import GPT
from holmes_lightning.topology import Topology


def calibrate(
    hybrid: Topology,
    profile: ModelProfile,
    model: ModelConfig,
    *,
    seconds: float,
    scale: float | None,
    fresh: bool = False,
) -> Calibration:
    """A lab rank of `hybrid` training `model`, each distinct layer timed for `seconds`; `scale` None: the lab's
    default bandwidth scale for this CPU; `fresh`: time the model even if its costs are cached."""
    sample = torch.zeros(1, model.seq_len, dtype=torch.long)
    layers = gpt(model).pipeline_layers()
    measured = calibration.measure(layers, sample, device=torch.device("cpu"), seconds=seconds, fresh=fresh)
    latency = calibration.local_handoff_latency_s(hybrid.world_size)
    scale, reason = (scale, "bench.bandwidth_scale") if scale is not None else default_bandwidth_scale(hybrid)
    return Calibration.of(
        measured,
        profile,
        share=1.0,
        shared_cores=available_cores(),
        latency_s=latency,
        bandwidth_scale=scale,
        scale_reason=reason,
        transfer_cpu_s_per_byte=lab_transfer_cpu_s_per_byte(hybrid),
    )


def lab_transfer_cpu_s_per_byte(hybrid: Topology) -> float:
    """What the lab's links cost this machine's cores per byte moved: `calibration.transfer_cpu_s_per_byte` run by
    `hybrid`'s ranks in the lab, links at half the fastest rate it shapes exactly; cached per machine and rank count."""
    scale = MAX_LAB_MBIT / 1000 / fastest_link_gbps(hybrid) / 2
    code = (
        "import sys, torch.distributed as dist; from holmes_lightning.calibration import transfer_cpu_s_per_byte; "
        "dist.init_process_group('gloo'); cost = transfer_cpu_s_per_byte(); "
        "dist.get_rank() or open(sys.argv[1], 'w').write(repr(cost)); dist.destroy_process_group()"
    )

    def measure() -> float:
        with tempfile.TemporaryDirectory() as folder:
            result = Path(folder) / "cpu_s_per_byte"
            if run_in_lab(hybrid, [sys.executable, "-c", code, str(result)], bandwidth_scale=scale):
                raise RuntimeError("measuring what the lab's links cost the cores failed; the ranks' output is above")
            return float(result.read_text())

    return calibration.cached_measurement(
        "lab-transfer", [hybrid.world_size, calibration.TRANSFER_BYTES, calibration.TRANSFER_ROUNDS], measure
    )


def gpt(model: ModelConfig, cls: type[GPT] = GPT) -> GPT:
    """The recipe's GPT (or a subclass of it) in the benchmark's shape."""
    return cls(
        n_layers=model.n_layers,
        d_model=model.d_model,
        n_heads=model.n_heads,
        seq_len=model.seq_len,
        vocab_size=model.vocab_size,
        dropout=model.dropout,
    )


def profile_gpt(model: ModelConfig) -> ModelProfile:
    """FLOPs (FlopCounterMode) and bytes of the recipe's pipeline layers on one sequence."""
    sample = torch.zeros(1, model.seq_len, dtype=torch.long)
    return profile_modules(gpt(model).pipeline_layers(), sample, name=model.name)


def lab_topology(topology: Topology, bandwidth_scale: float, device_tflops: float) -> Topology:
    """The topology as the lab runs it: every device at `device_tflops`, every link's speed x `bandwidth_scale`."""
    scaled = topology.at_link_scale(bandwidth_scale).spec
    clusters = [replace(group, device_tflops=None) for group in scaled.clusters]
    return Topology(replace(scaled, name=f"{scaled.name}_lab", clusters=clusters, device_tflops=device_tflops))


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
