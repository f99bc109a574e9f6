"""The cost model's hardware for the lab: a rank's compute measured in one process, links x the lab's scale.

A lab rank is one CPU thread. Its costs are measured, not assumed: one process times forward + backward of the
benchmark's GPT at two sample counts (the slope is the speed per sample, what is left at zero samples the fixed
cost of a pass, spread over the layers) and one AdamW step. When the job has more ranks than cores, ranks share
them, so each is credited cores / ranks of it. Links run at their configured speed x the lab's bandwidth scale, as
the lab shapes them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch

from holmes_lightning.config import ModelConfig
from holmes_lightning.lab.scale import default_bandwidth_scale
from holmes_lightning.measure import profile_modules, rank_share
from holmes_lightning.planner import ModelProfile
from holmes_lightning.recipes import GPT
from holmes_lightning.topology import LinkSpec, Topology

FIT_SAMPLES = (1, 4)  # forward + backward is timed at these sample counts


@dataclass(frozen=True)
class Calibration:
    """One lab rank as the cost model sees it, and what was measured for it (one process, one thread).

    Measured: `gflops` per marginal sample, `pass_overhead_s` (forward + backward at zero samples) and
    `optimizer_s` (one AdamW step over the model). The cost model gets them at the rank's core `share`:
    `device_tflops`, `layer_overhead_s` (per layer and micro-batch) and `optimizer_s_per_gb`.
    """

    gflops: float
    pass_overhead_s: float
    optimizer_s: float
    share: float
    device_tflops: float
    layer_overhead_s: float
    optimizer_s_per_gb: float
    bandwidth_scale: float
    scale_reason: str

    @classmethod
    def measure(
        cls, hybrid: Topology, profile: ModelProfile, model: ModelConfig, repeats: int, scale: float | None
    ) -> Calibration:
        """Time the model here; `scale` None: the lab's default bandwidth scale for this CPU."""
        passes, optimizer_s = training_seconds(model, FIT_SAMPLES, repeats)
        (few, many), (short, long) = FIT_SAMPLES, passes
        per_sample_s = max(long - short, 1e-9) / (many - few)
        overhead_s = max(short - few * per_sample_s, 0.0)
        gflops = profile.flops_per_sample / per_sample_s / 1e9
        share = rank_share(hybrid.world_size)
        scale, reason = (scale, "bench.bandwidth_scale") if scale is not None else default_bandwidth_scale(hybrid)
        return cls(
            gflops=gflops,
            pass_overhead_s=overhead_s,
            optimizer_s=optimizer_s,
            share=share,
            device_tflops=gflops * share / 1e3,
            layer_overhead_s=overhead_s / profile.num_layers / share,
            optimizer_s_per_gb=optimizer_s / (profile.param_bytes / 1e9) / share,
            bandwidth_scale=scale,
            scale_reason=reason,
        )

    def describe(self) -> str:
        return (
            f"one rank, measured alone: {self.gflops:.2f} GFLOP/s per sample + {self.pass_overhead_s * 1e3:.1f} ms "
            f"per forward+backward pass, AdamW step {self.optimizer_s * 1e3:.1f} ms; x {self.share:g} core share -> "
            f"device_tflops={self.device_tflops:.3g}, layer_overhead_s={self.layer_overhead_s:.3g}, "
            f"optimizer_s_per_gb={self.optimizer_s_per_gb:.3g}; bandwidth_scale={self.bandwidth_scale:.3g} "
            f"({self.scale_reason})"
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


def training_seconds(model: ModelConfig, samples: tuple[int, ...], repeats: int) -> tuple[list[float], float]:
    """Median single-thread seconds of forward + backward at each sample count, and of one AdamW step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        net = gpt(model)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        passes: dict[int, list[float]] = {n: [] for n in samples}
        updates = []
        for _ in range(repeats + 1):  # the first round warms up allocator and kernels
            for n in samples:
                tokens = torch.randint(0, model.vocab_size, (n, model.seq_len + 1))
                start = time.perf_counter()
                net.pipeline_loss(net(tokens[:, :-1]), tokens[:, 1:]).backward()
                passes[n].append(time.perf_counter() - start)
            start = time.perf_counter()
            optimizer.step()
            updates.append(time.perf_counter() - start)
            optimizer.zero_grad(set_to_none=True)
        return [statistics.median(passes[n][1:]) for n in samples], statistics.median(updates[1:])
    finally:
        torch.set_num_threads(threads)


def lab_topology(topology: Topology, bandwidth_scale: float, device_tflops: float) -> Topology:
    """The topology as the lab runs it: every device at `device_tflops`, every link's speed x `bandwidth_scale`."""
    spec = topology.spec
    clusters = [
        replace(group, nic=replace(group.nic, gbps=group.nic.gbps * bandwidth_scale), device_tflops=None)
        for group in spec.clusters
    ]
    lab_spec = replace(
        spec,
        name=f"{spec.name}_lab",
        clusters=clusters,
        device_tflops=device_tflops,
        intra_node=LinkSpec(spec.intra_node.gbps * bandwidth_scale),
        inter_cluster=spec.inter_cluster.scaled(bandwidth_scale),
    )
    return Topology(lab_spec)


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
