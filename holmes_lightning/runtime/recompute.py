"""Activation checkpointing of pipeline layers, as the plan says per stage (`StagePlan.checkpointing`): a checkpointed
layer keeps only its inputs for the backward pass and runs its forward again there (torch's non-reentrant
checkpoint, the random state restored so dropout draws the same masks). Applied before sharding, as torchtitan
applies it; the layer stays the same module (its parameter names, its FSDP hooks), only its `forward` is wrapped."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from holmes_lightning.planner import Checkpointing


def checkpoint_layers(layers: Sequence[nn.Module | None], owned: Sequence[int], choice: Checkpointing) -> None:
    """Checkpoint the owned layers `choice` names (`Checkpointing.recomputed`, by index in the whole model)."""
    recomputed = choice.recomputed(len(layers))
    for index in owned:
        if recomputed[index]:
            layer = layers[index]
            layer.forward = functools.partial(_recomputed, layer.forward)


def _recomputed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
