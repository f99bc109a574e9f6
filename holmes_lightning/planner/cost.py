"""The cost model: compute seconds per layer on a device, DP sync and p2p seconds over a link, memory per device."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from holmes_lightning.planner.plan_types import Sharding
from holmes_lightning.planner.profile import ModelProfile
from holmes_lightning.topology import Link, Topology


@dataclass(frozen=True)
class CostModel:
    """Seconds and bytes of one plan's pieces.

    - Compute: FLOPs / (device peak TFLOPS x `efficiency`), or measured seconds scaled by the device's speed relative
      to the device they were measured on, per sample; plus `layer_overhead_s` per layer and micro-batch whatever
      its size (kernel launches, framework hooks), split 1:2 between forward and backward like the FLOPs.
    - Optimizer step: `optimizer_s_per_gb` x the GB of parameters a rank holds, after its DP sync.
    - DP sync per step: ring reduce-scatter + all-gather (FSDP) or all-reduce (replicas) of the stage's gradient
      bytes, 2 (n-1)/n x bytes over the group's slowest link. On `backend="gloo"` a reduce-scatter runs as a whole
      all-reduce, so FSDP moves 3 (n-1)/n x bytes there. The sync starts with the last micro-batch's backward
      (earlier ones accumulate locally); `dp_overlap` is the fraction of it that can run under that backward.
    - Memory per device, what training allocates beyond the process's own baseline (interpreter, torch, CUDA
      context): the rank's parameters x `state_multiplier` (weights + grads + optimizer states per parameter byte;
      4 for fp32 AdamW), FSDP's unsharded weights and gradients, and the activations autograd keeps for the
      micro-batches in flight (the profile's stash; the last layer's counts the output and the loss's copy of it).
    """

    topology: Topology
    profile: ModelProfile
    efficiency: float = 0.5
    dp_overlap: float = 0.5
    sharding: Sharding = Sharding.fsdp
    state_multiplier: float = 4.0
    rdma: bool = True
    backend: str = "nccl"
    layer_overhead_s: float = 0.0
    optimizer_s_per_gb: float = 0.0

    def layer_seconds(self, device_tflops: float) -> tuple[list[float], list[float]]:
        """Forward and backward seconds per sample of every layer on a device of this peak speed."""
        layers = self.profile.layers
        if all(layer.measured for layer in layers):
            reference = self.profile.measured_tflops or max(n.device_tflops for n in self.topology.nodes)
            scale = reference / device_tflops
            return [layer.forward_s * scale for layer in layers], [layer.backward_s * scale for layer in layers]
        flops_per_s = device_tflops * 1e12 * self.efficiency
        return [la.forward_flops / flops_per_s for la in layers], [la.backward_flops / flops_per_s for la in layers]

    def microbatch_seconds(self, device_tflops: float, microbatch_size: int) -> tuple[list[float], list[float]]:
        """Forward and backward seconds of every layer for one micro-batch of `microbatch_size` samples."""
        forward, backward = self.layer_seconds(device_tflops)
        overhead = self.layer_overhead_s / 3
        return (
            [f * microbatch_size + overhead for f in forward],
            [b * microbatch_size + 2 * overhead for b in backward],
        )

    def update_s(self, param_bytes: float, dp: int) -> float:
        """The optimizer step over the parameters one rank of a stage holds (its shard under FSDP)."""
        held = param_bytes / dp if self.sharding is Sharding.fsdp else param_bytes
        return self.optimizer_s_per_gb * held / 1e9

    def dp_link(self, ranks: tuple[int, ...]) -> Link:
        return self.topology.slowest_link(ranks, rdma=self.rdma)

    def dp_sync_s(self, group_size: int, link: Link, param_bytes: float) -> float:
        """Ring sync of `param_bytes` over a group of this size whose slowest link is `link`."""
        passes = 3 if self.sharding is Sharding.fsdp and self.backend == "gloo" else 2
        return passes * (group_size - 1) / group_size * param_bytes / link.bytes_per_s

    def exposed_sync_s(self, sync_s: float, backward_s: float) -> float:
        """The part of the DP sync backward does not hide (`backward_s`: the last micro-batch's backward seconds)."""
        return max(sync_s * (1 - self.dp_overlap), sync_s - backward_s)

    def memory_bytes(self, param_bytes: float, *, dp: int, stash_bytes: float, pipelined: bool) -> float:
        """Peak bytes per device of a stage whose `dp` ranks hold `param_bytes` and keep `stash_bytes` of activations.

        FSDP shards weights, gradients and optimizer states over the DP group, and holds unsharded copies besides:
        in a pipeline the stage's whole weights stay gathered for the step and its gradients accumulate unsharded
        over the micro-batches; without one, about two layers' worth of each (the layer computing, the prefetched).
        (With gradient accumulation a pipelined step also holds the window's earlier gradients while its schedule
        runs: one more copy of the rank's gradients, not counted here.)
        """
        sharded = self.sharding is Sharding.fsdp and dp > 1
        held = param_bytes / dp if sharded else param_bytes
        total = held * self.state_multiplier + stash_bytes
        if sharded:
            total += 2 * (param_bytes if pipelined else min(param_bytes, 2 * self.largest_layer_bytes))
        return total

    @cached_property
    def largest_layer_bytes(self) -> float:
        return max(layer.param_bytes for layer in self.profile.layers)
