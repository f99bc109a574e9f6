"""FSDP2 over a stage's DP sub-mesh (or replicate-only sync), and gradient clipping by the norm over all stages."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

SHARDINGS = ("fsdp", "none")


def shard(
    layers: Sequence[nn.Module],
    root: nn.Module,
    mesh: DeviceMesh,
    sharding: str,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool,
) -> None:
    """One FSDP unit per layer (so reduce-scatter overlaps backward and all-gathers prefetch), then the root.

    `sharding="none"` keeps full replicas and all-reduces gradients per layer, DDP-style, through the same hooks.
    """
    if sharding == "fsdp":
        for module in (*layers, root):
            fully_shard(module, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    else:
        for module in (*layers, root):
            replicate(module, mesh=mesh, mp_policy=mp_policy)


def clip_grad_norm_(
    parameters: Iterable[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    """Scale gradients so their 2-norm over the whole model (all shards, all pipeline stages) is at most `max_norm`."""
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=device)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if pp_group is not None and pp_group.size() > 1:
        squared = norm.pow(2)
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm
