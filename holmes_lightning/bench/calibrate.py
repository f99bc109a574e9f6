"""The cost model's hardware for the lab: device speed from a measured single-process step, links x the lab's scale.

A lab rank is one CPU thread. Its speed is measured, not assumed: one process runs whole training steps (forward,
backward, AdamW) of the benchmark's GPT on the samples one rank computes per step, and model FLOPs / median step
seconds is its speed. When the job has more ranks than cores, ranks share them, so each is credited
cores / ranks of it. Links run at their configured speed x the lab's bandwidth scale, as the lab shapes them.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace

import torch

from holmes_lightning.config import ModelConfig
from holmes_lightning.planner import ModelProfile
from holmes_lightning.topology import LinkSpec, Topology
from recipes import GPT


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
    return ModelProfile.from_modules(gpt(model).pipeline_layers(), sample, name=model.name)


def step_seconds(model: ModelConfig, samples: int, repeats: int) -> float:
    """Median seconds of one single-thread training step (forward, backward, AdamW) on `samples` sequences."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        net = gpt(model)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        tokens = torch.randint(0, model.vocab_size, (samples, model.seq_len + 1))
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        times = []
        for _ in range(repeats + 1):  # the first step warms up allocator and kernels
            start = time.perf_counter()
            net.pipeline_loss(net(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])
    finally:
        torch.set_num_threads(threads)


def rank_share(world_size: int) -> float:
    """The fraction of a core each rank gets when every rank computes at once."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(1.0, cores / world_size)


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
        inter_cluster=LinkSpec(spec.inter_cluster.gbps * bandwidth_scale),
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
