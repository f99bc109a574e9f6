"""FSDP2 over a stage's DP sub-mesh, replicas' gradient averaging, and gradient clipping over all stages."""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from holmes_lightning.planner import Plan, Sharding
from holmes_lightning.planner.cost import BUCKET_BYTES

BUCKETS_IN_FLIGHT = 2  # one bucket reduces while the next is flattened


GradientSync = Callable[[], None]


def parallelize(
    root: nn.Module,
    *,
    layers: Sequence[nn.Module],
    mesh: DeviceMesh,
    plan: Plan,
    mp_policy: MixedPrecisionPolicy,
    fsdp_on_one_rank: bool = False,
) -> GradientSync | None:
    """Apply the plan's data parallelism to one model chunk over its stage's DP mesh, always in this order.

    1. A group of one rank has nothing to shard or sync: the chunk stays a plain module, unless `fsdp_on_one_rank`
       and the plan shards (FSDP2 then runs as on many ranks: its hooks, DTensor parameters and `mp_policy`).
    2. FSDP2: `fully_shard` each layer (its reduce-scatter overlaps the backward of the layers before it, its
       all-gather is prefetched), then the chunk's root, which the pipeline unshards at the start of each step.
       Weights are freed after forward per `plan.reshard_after_forward`. Layers that share a weight (a tied
       embedding and head) are left to the root, so the weight stays one parameter.
    3. Replicas without a pipeline: `replicate` each layer (tied ones left to the root), then the root (gradient
       all-reduces overlap backward).
    4. Replicas in a pipeline stay plain modules: per-layer hooks would fire for every micro-batch on the critical
       path, so the returned sync averages their gradients once, after the schedule.

    Returns the gradient sync the pipeline must run after each schedule step (case 4), else None.
    """
    if mesh.size() == 1 and not (fsdp_on_one_rank and plan.is_fsdp):
        return None
    wrapped = (*_untied(layers), root)
    if plan.sharding == Sharding.fsdp:
        for module in wrapped:
            fully_shard(module, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=plan.reshard_after_forward)
        return None
    if not plan.is_pipelined:
        for module in wrapped:
            replicate(module, mesh=mesh, mp_policy=mp_policy)
        return None
    group = mesh.get_group()
    return lambda: average_gradients(root.parameters(), group)


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """The modules of `module` that FSDP2 shards or `replicate` replicates (each gathers and frees its weights)."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _untied(layers: Sequence[nn.Module]) -> list[nn.Module]:
    """The layers that share no parameter with another layer."""
    holders: dict[int, set[int]] = defaultdict(set)
    for index, layer in enumerate(layers):
        for param in layer.parameters():
            holders[id(param)].add(index)
    tied = {index for found in holders.values() if len(found) > 1 for index in found}
    return [layer for index, layer in enumerate(layers) if index not in tied]


def average_gradients(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average full-replica gradients over `group`, a few flat all-reduces of up to `BUCKET_BYTES` each.

    At most `BUCKETS_IN_FLIGHT` flat copies exist at once, so the sync never holds a second copy of the gradients.
    """
    pending: deque[tuple[list[torch.Tensor], torch.Tensor, dist.Work]] = deque()
    for bucket in _buckets([p.grad for p in parameters if p.grad is not None]):
        flat = torch._utils._flatten_dense_tensors(bucket)
        pending.append((bucket, flat, dist.all_reduce(flat, group=group, async_op=True)))
        if len(pending) == BUCKETS_IN_FLIGHT:
            _average_into(*pending.popleft(), group.size())
    while pending:
        _average_into(*pending.popleft(), group.size())


def _average_into(bucket: list[torch.Tensor], flat: torch.Tensor, work: dist.Work, size: int) -> None:
    work.wait()
    flat.div_(size)
    for grad, synced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True):
        grad.copy_(synced)


def _buckets(grads: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, up to `BUCKET_BYTES` per bucket."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        by_kind[(grad.dtype, grad.device)].append(grad)
    for kind in by_kind.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for grad in kind:
            if bucket and size + grad.numel() * grad.element_size() > BUCKET_BYTES:
                yield bucket
                bucket, size = [], 0
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
        yield bucket


def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None,
    device: torch.device,
    uncounted: set[int] = frozenset(),
) -> torch.Tensor:
    """Scale gradients so their 2-norm over the whole model (all shards, all pipeline stages) is at most `max_norm`.

    `uncounted`: `id()`s of parameters scaled but left out of the norm (a tied weight's copy on a later stage).
    """
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters if id(p) not in uncounted]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=device)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if pp_group is not None and pp_group.size() > 1:  # in float32 on every stage, whatever its gradients' dtype
        squared = norm.float().pow(2)
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm
