"""The cost model: compute seconds per layer on a device, DP sync and p2p seconds over a link, memory per device."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from functools import cached_property

from holmes_lightning.planner.options import Backend, Check, check_fields
from holmes_lightning.planner.plan_types import Sharding, reshards_after_forward
from holmes_lightning.planner.profile import ModelProfile
from holmes_lightning.topology import Link, Topology

GLOO_EARLY_BYTES = 20 * 2**10  # of a gloo (TCP) message, what crosses before its recv is posted: the receiver's
# socket takes it unread. Measured in the lab: 15-23 KB at every size from 32 KB to 1 MB, a 16 KB message whole.
BUCKET_BYTES = 25 * 2**20  # gradients per all-reduce of pipelined replicas (DDP's default: few collectives, bounded
# extra memory); `runtime.sharding.average_gradients` buckets by it


def sync_passes(sharding: Sharding, backend: Backend, *, pipelined: bool) -> int:
    """How many times a step's DP sync moves (n-1)/n of a stage's parameter bytes out of each of its n ranks: FSDP's
    all-gathers (one pipelined, two without) and reduce-scatter (a whole all-reduce, two, on gloo); replicas'
    all-reduce (two)."""
    if sharding is not Sharding.fsdp:
        return 2
    return (2 if reshards_after_forward(pipelined=pipelined) else 1) + (2 if backend == Backend.gloo else 1)


def gradient_passes(sharding: Sharding, backend: Backend) -> int:
    """Of `sync_passes`, those that move gradients: all but FSDP's all-gathers of the weights."""
    return (2 if backend == Backend.gloo else 1) if sharding is Sharding.fsdp else 2


def sync_bytes(
    sharding: Sharding,
    backend: Backend,
    group_size: int,
    param_bytes: float,
    *,
    pipelined: bool,
    frozen_bytes: float = 0.0,
) -> float:
    """Bytes each rank of a DP group of `group_size` sends in a step's sync for a stage holding `param_bytes`, of
    which `frozen_bytes` have no gradients (gathered, never reduced)."""
    n = group_size
    moved = sync_passes(sharding, backend, pipelined=pipelined) * (n - 1) / n * param_bytes
    return moved - gradient_passes(sharding, backend) * (n - 1) / n * frozen_bytes


NON_NEGATIVE: Check = (lambda value: value >= 0, "use seconds >= 0")
OPTIONAL_NON_NEGATIVE: Check = (lambda value: value is None or value >= 0, "use seconds >= 0, or None: not measured")


def _cost(default: float | None, check: Check = NON_NEGATIVE, *, compute: bool = False) -> float | None:
    """A `MachineCosts` field: its default, what its values must satisfy, and whether it is compute time (a device
    `slowed` by a factor takes that much longer for it)."""
    return field(default=default, metadata={"check": check, "compute": compute})


@dataclass(frozen=True)
class MachineCosts:
    """What the machine costs the cost model: measured on the job's model at its start (`HolmesStrategy(calibrate=
    True)`, `measure.calibration`), else assumed (these defaults, or the `costs` the user gives).

    efficiency: fraction of the device's peak TFLOPS layers reach (above 1 where calibration measured the device
    faster than the cluster config says). layer_overhead_s: seconds each layer adds to every
    micro-batch whatever its size (kernel launches, framework hooks), so more micro-batches are not free.
    optimizer_s_per_gb: optimizer step seconds per GB of parameters a rank holds. latency_s: seconds every message
    adds whatever its size (a pipeline transfer, each step of a ring collective). fsdp_layer_s / fsdp_reshard_layer_s:
    FSDP2's hooks per layer and micro-batch with the weights kept gathered (a pipeline) / freed after forward (pp=1);
    fsdp_optimizer_layer_s: what DTensor parameters add to the optimizer step per layer. dp_overlap: fraction of the
    DP sync hidden under the computation without a pipeline (assumed, not measured). shared_cores: every rank
    computes on this many CPU cores of one machine (None: each rank on its own device). closing_s: seconds a
    pipelined step spends after its schedule in small collectives over every rank (None: the loss's all-reduce at
    latency_s). message_cpu_s: CPU seconds both ends of a pipeline message spend on it, which ranks sharing cores
    lose for computing. device_memory_gb: what a rank may allocate for training (its device's memory less a
    reserve), a bound on every plan besides the user's `memory_limit_gb` (None: unbounded). weight_share: of a
    backward's seconds, what its weight-gradient pass takes (the pass a zero-bubble schedule runs apart), timed on
    the whole model at calibration; each layer's FLOP share is scaled to it (None: the FLOP shares as they are,
    `LayerProfile.weight_share`). See `CostModel` for how each enters the step.
    """

    efficiency: float = _cost(0.5, (lambda value: value > 0, "use a fraction of peak > 0"))
    layer_overhead_s: float = _cost(0.0, compute=True)
    optimizer_s_per_gb: float = _cost(0.0, compute=True)
    latency_s: float = _cost(0.0)
    fsdp_layer_s: float = _cost(0.0, compute=True)
    fsdp_reshard_layer_s: float = _cost(0.0, compute=True)
    fsdp_optimizer_layer_s: float = _cost(0.0, compute=True)
    dp_overlap: float = _cost(0.5, (lambda value: 0 <= value <= 1, "use a fraction in [0, 1]"))
    shared_cores: float | None = _cost(
        None, (lambda value: value is None or value > 0, "use the machine's core count, or None (a device per rank)")
    )
    closing_s: float | None = _cost(None, OPTIONAL_NON_NEGATIVE)
    message_cpu_s: float = _cost(0.0)
    device_memory_gb: float | None = _cost(
        None, (lambda value: value is None or value > 0, "use the GB a rank may allocate, or None (unbounded)")
    )
    weight_share: float | None = _cost(
        None, (lambda value: value is None or 0 <= value <= 1, "use a fraction in [0, 1], or None (from the FLOPs)")
    )

    def __post_init__(self) -> None:
        check_fields(self, {f.name: f.metadata["check"] for f in fields(self)})

    def slowed(self, factor: float) -> MachineCosts:
        """These costs on a device `factor` times slower: every compute time x `factor`."""
        return replace(self, **{f.name: getattr(self, f.name) * factor for f in fields(self) if f.metadata["compute"]})

    @property
    def free_hooks(self) -> bool:
        """Messages, FSDP hooks and DTensor optimizer steps cost nothing extra (an uncalibrated NCCL job)."""
        return self.latency_s == self.fsdp_layer_s == self.fsdp_optimizer_layer_s == 0


@dataclass(frozen=True)
class CostModel:
    """Seconds and bytes of one plan's pieces, as the runtime runs them.

    `machine` holds what the hardware costs (`MachineCosts`); the rest is what the plan runs (sharding, backend,
    whether its communicators use RDMA) and `state_multiplier` bytes of state per parameter byte.

    - Compute: FLOPs / (device peak TFLOPS x `efficiency`), or measured seconds scaled by the device's speed relative
      to the device they were measured on, per sample; plus `layer_overhead_s` per layer and micro-batch whatever
      its size (kernel launches, framework hooks), split 1:2 between forward and backward like the FLOPs.
    - Data parallelism over more than one rank wraps every layer (a group of one stays a plain module): FSDP2's hooks
      cost `fsdp_layer_s` per layer and micro-batch while the weights stay gathered (a pipeline), and
      `fsdp_reshard_layer_s` per layer and pass when they are freed after forward and gathered again for backward
      (pp=1, `Plan.reshard_after_forward`; pp=1 replicas use FSDP's machinery too, at `fsdp_layer_s`).
    - Optimizer step: `optimizer_s_per_gb` x the GB of parameters a rank holds, after its DP sync, plus
      `fsdp_optimizer_layer_s` per layer where the parameters are DTensors (FSDP2 and pp=1 replicas over > 1 rank).
    - DP sync per step, over the group's slowest link: FSDP all-gathers (n-1)/n x the stage's bytes once per step in
      a pipeline (weights stay gathered over its micro-batches), twice without one, and reduce-scatters the
      gradients once ((n-1)/n x bytes; on `backend="gloo"` a reduce-scatter runs as a whole all-reduce, 2 (n-1)/n);
      replicas all-reduce them (2 (n-1)/n). Every collective is per layer, except pipelined replicas' (buckets of
      `BUCKET_BYTES`), and each of its ring steps costs `latency_s` too.
    - Only without a pipeline does the sync run under the computation (`dp_overlap` of it at most, and no more than
      the forward and backward pass): a pipeline reduces after its schedule's last backward.
    - Pipeline transfers: activation bytes over the link between the stages, plus `latency_s` per message. On gloo
      the first `GLOO_EARLY_BYTES` of a message cross before the receiver posts its recv (`early_s`); NCCL moves
      nothing until both sides are posted.
    - A pipelined step closes with small collectives over every rank (the loss's all-reduce, the training loop's
      own): `closing_s` where measured (HolmesStrategy does, at job start), else the loss's at `latency_s`.
    - `shared_cores`: every rank computes on this many CPU cores of one machine (None: each on its own device), at
      its speed alone while no more ranks than cores compute, slower beside more (`planner.sharing`); its optimizer
      step runs beside every other rank's, and a pipeline message's CPU (`message_cpu_s`, both ends) joins the pass
      that sends it.
    - Memory per device, what training allocates beyond the process's own baseline (interpreter, torch, CUDA
      context): the rank's parameters x `state_multiplier` (weights + grads + optimizer states per parameter byte;
      4 for fp32 AdamW), FSDP's unsharded weights and gradients, and the activations autograd keeps for the
      micro-batches in flight (the profile's stash; the last layer's counts the output and the loss's copy of it).
    """

    topology: Topology
    profile: ModelProfile
    machine: MachineCosts = MachineCosts()
    sharding: Sharding = Sharding.fsdp
    state_multiplier: float = 4.0
    rdma: bool = True
    backend: Backend = Backend.nccl

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", Backend(self.backend))

    def layer_seconds(self, device_tflops: float) -> tuple[list[float], list[float]]:
        """Forward and backward seconds per sample of every layer on a device of this peak speed."""
        layers = self.profile.layers
        if all(layer.measured for layer in layers):
            reference = self.profile.measured_tflops or max(n.device_tflops for n in self.topology.nodes)
            scale = reference / device_tflops
            return [layer.forward_s * scale for layer in layers], [layer.backward_s * scale for layer in layers]
        flops_per_s = device_tflops * 1e12 * self.machine.efficiency
        return [la.forward_flops / flops_per_s for la in layers], [la.backward_flops / flops_per_s for la in layers]

    def weight_shares(self) -> list[float]:
        """Per layer, the share of its backward's seconds in its weight-gradient pass: its FLOP share, scaled so that
        the whole model's is the measured `MachineCosts.weight_share` where calibration timed it."""
        layers, measured = self.profile.layers, self.machine.weight_share
        shares = [layer.weight_share for layer in layers]
        backward = sum(layer.backward_flops for layer in layers)
        counted = sum(share * layer.backward_flops for share, layer in zip(shares, layers, strict=True))
        if measured is None or counted <= 0:
            return shares
        scale = measured * backward / counted
        return [min(1.0, share * scale) for share in shares]

    def microbatch_seconds(
        self, device_tflops: float, microbatch_size: int, *, dp: int = 1, pipelined: bool = True
    ) -> tuple[list[float], list[float]]:
        """Forward and backward seconds of every layer for one micro-batch of `microbatch_size` samples, on a stage of
        `dp` ranks (its data-parallel hooks included)."""
        forward, backward = self.layer_seconds(device_tflops)
        overhead = (self.machine.layer_overhead_s + self.hook_s(dp, pipelined)) / 3
        return (
            [f * microbatch_size + overhead for f in forward],
            [b * microbatch_size + 2 * overhead for b in backward],
        )

    def hook_s(self, dp: int, pipelined: bool) -> float:
        """What data parallelism's per-layer hooks add to each layer's forward + backward of one micro-batch."""
        if dp == 1 or (self.sharding is not Sharding.fsdp and pipelined):  # plain modules
            return 0.0
        if self.sharding is Sharding.fsdp and reshards_after_forward(pipelined=pipelined):
            return self.machine.fsdp_reshard_layer_s
        return self.machine.fsdp_layer_s

    def update_s(
        self, param_bytes: float, dp: int, *, layers: int = 0, pipelined: bool = True, frozen_bytes: float = 0.0
    ) -> float:
        """The optimizer step over the parameters one rank of a stage holds (its shard under FSDP), of `layers`;
        `frozen_bytes` of them do not train."""
        trained = param_bytes - frozen_bytes
        held = trained / dp if self.sharding is Sharding.fsdp else trained
        on_dtensors = dp > 1 and (self.sharding is Sharding.fsdp or not pipelined)
        return self.machine.optimizer_s_per_gb * held / 1e9 + (
            self.machine.fsdp_optimizer_layer_s * layers if on_dtensors else 0.0
        )

    def dp_link(self, ranks: tuple[int, ...]) -> Link:
        return self.topology.slowest_link(ranks, rdma=self.rdma)

    def dp_sync_s(
        self,
        group_size: int,
        link: Link,
        param_bytes: float,
        *,
        layers: int = 1,
        pipelined: bool = True,
        share: bool = False,
        frozen_bytes: float = 0.0,
    ) -> float:
        """Seconds of one step's collectives over a DP group of this size whose slowest link is `link`, for a stage
        of `layers` layers holding `param_bytes` (`frozen_bytes` of them without gradients); `share`: what part of a
        stage these add at least (linear in them, replicas' buckets counted in fractions), so shares of a stage's
        parts sum to at most its sync."""
        n = group_size
        if n == 1:
            return 0.0
        moved = sync_bytes(self.sharding, self.backend, n, param_bytes, pipelined=pipelined, frozen_bytes=frozen_bytes)
        seconds = moved / link.bytes_per_s
        if self.sharding is Sharding.fsdp:
            passes = sync_passes(self.sharding, self.backend, pipelined=pipelined)
            return seconds + passes * (n - 1) * layers * self.machine.latency_s
        trained = param_bytes - frozen_bytes
        buckets = trained / BUCKET_BYTES if share else math.ceil(trained / BUCKET_BYTES)
        collectives = buckets if pipelined else layers
        return seconds + collectives * 2 * (n - 1) * self.machine.latency_s

    def exposed_sync_s(self, sync_s: float, compute_s: float, *, pipelined: bool = False) -> float:
        """The part of the DP sync the computation does not hide: all of it in a pipeline (it runs after the
        schedule); else at most `dp_overlap` of it, and no more than `compute_s` (the pass's forward + backward)."""
        if pipelined:
            return sync_s
        return max(sync_s * (1 - self.machine.dp_overlap), sync_s - compute_s)

    def transfer_s(self, nbytes: float, link: Link) -> float:
        """One pipeline message of `nbytes` over `link`."""
        return self.machine.latency_s + nbytes / link.bytes_per_s

    def early_s(self, nbytes: float, link: Link) -> float:
        """The part of `transfer_s` that may run before the receiver posts its recv."""
        early = min(nbytes, GLOO_EARLY_BYTES) if self.backend is Backend.gloo else 0.0
        return early / link.bytes_per_s

    @property
    def pass_message_cpu_s(self) -> float:
        """What a pass that sends a pipeline message adds for the message's CPU: ranks sharing cores only."""
        return self.machine.message_cpu_s if self.machine.shared_cores is not None else 0.0

    def step_collective_s(self, world_size: int) -> float:
        """What a pipelined step spends after its schedule in small collectives over every rank: `closing_s` where
        measured, else the all-reduce of the loss every rank logs: its latency, 2 (n-1) messages in gloo's ring,
        2 log2(n) in NCCL's tree."""
        if self.machine.closing_s is not None:
            return self.machine.closing_s
        messages = 2 * (world_size - 1) if self.backend is Backend.gloo else 2 * math.ceil(math.log2(world_size))
        return messages * self.machine.latency_s

    def memory_bytes(
        self, param_bytes: float, *, dp: int, stash_bytes: float, pipelined: bool, frozen_bytes: float = 0.0
    ) -> float:
        """Peak bytes per device of a stage whose `dp` ranks hold `param_bytes` and keep `stash_bytes` of activations;
        of the parameters, `frozen_bytes` hold only their weights (no gradients or optimizer states).

        FSDP shards weights, gradients and optimizer states over the DP group, and holds unsharded copies besides:
        in a pipeline the stage's whole weights stay gathered for the step and its gradients accumulate unsharded
        over the micro-batches; without one, about two layers' worth of each (the layer computing, the prefetched).
        (With gradient accumulation a pipelined step also holds the window's earlier gradients while its schedule
        runs: one more copy of the rank's gradients, not counted here.)
        """
        sharded = self.sharding is Sharding.fsdp and dp > 1
        held = param_bytes / dp if sharded else param_bytes
        frozen = frozen_bytes / dp if sharded else frozen_bytes  # no gradients or optimizer states
        total = held * self.state_multiplier + stash_bytes - frozen * (self.state_multiplier - 1)
        if sharded:  # unsharded weights and gradients (none for the frozen ones)
            total += 2 * (param_bytes if pipelined else min(param_bytes, 2 * self.largest_layer_bytes))
            total -= frozen_bytes if pipelined else min(frozen_bytes, 2 * self.largest_layer_bytes)
        return total

    @cached_property
    def largest_layer_bytes(self) -> float:
        return max(layer.param_bytes for layer in self.profile.layers)
