"""Checkpoints without the frozen weights (`HolmesStrategy(checkpoint_frozen=False)`): a LoRA fine-tune's checkpoint
holds its adapter, optimizer states and loops, not the pretrained model it builds again at every start.

A resume takes the frozen weights from the model as it was built. So each such checkpoint records, per weight it left
out, its elements, sum and sum of squares (float64, over the whole tensor, whichever ranks hold its shards), and a
resume whose frozen weights differ from those (another base model, another dtype) is refused, naming one of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

FINGERPRINT_KEY = "holmes_frozen_weights"  # in Lightning's part of a checkpoint: the frozen weights it left out
TOLERANCE = 1e-9  # relative: the same weights summed in another order (another plan's shards) differ by far less

Fingerprint = dict[str, tuple[int, float, float]]


def frozen_names(module: nn.Module) -> set[str]:
    """The state-dict names of `module`'s parameters that do not train (every name of a tied one)."""
    return {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def split(state: Mapping[str, Any], module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """`state` (the module's) as its part that trains (buffers too) and its frozen weights."""
    names = frozen_names(module)
    trained = {name: value for name, value in state.items() if name not in names}
    return trained, {name: value for name, value in state.items() if name in names}


def fingerprint(state: Mapping[str, Any], names: Collection[str], gather: Callable[[Any], list[Any]]) -> Fingerprint:
    """Per name in `names` (this rank's frozen weights): elements, sum and sum of squares of the whole tensor. Every
    rank calls this; each gets every stage's (`gather`: every rank's value, by rank)."""
    found = {}
    for name in sorted(names):  # the same order on every rank of a stage: their shards reduce together
        tensor = state[name]
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        sums = torch.stack([local.sum(dtype=torch.float64), torch.linalg.vector_norm(local, dtype=torch.float64) ** 2])
        if isinstance(tensor, DTensor) and any(placement.is_shard() for placement in tensor.placements):
            dist.all_reduce(sums, group=tensor.device_mesh.get_group())
        total, squares = sums.tolist()
        found[name] = (tensor.numel(), total, squares)
    return {name: value for part in gather(found) for name, value in part.items()}


def differing(saved: Fingerprint, current: Fingerprint) -> list[str]:
    """The frozen weights of `saved` whose fingerprint `current` (this model's) does not match."""
    return [name for name, values in saved.items() if name not in current or not _same(values, current[name])]


def _same(saved: tuple[int, float, float], current: tuple[int, float, float]) -> bool:
    (elements, total, squares), (elements_now, total_now, squares_now) = saved, current
    scale = math.sqrt(elements * squares)  # bounds the sum of magnitudes
    return (
        elements == elements_now
        and abs(total - total_now) <= TOLERANCE * max(scale, 1.0)
        and abs(squares - squares_now) <= TOLERANCE * max(squares, 1.0)
    )
