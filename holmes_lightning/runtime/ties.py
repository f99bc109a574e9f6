"""Weights tied across pipeline layers (a token embedding and the LM head that reuses it, as GPT-2 and Llama-3.2 do).

On one rank a tied weight is one parameter, as in the model. When its holders sit on different stages each stage
keeps a copy: the copies start from the first holder's values, and after every step's gradient sync their gradients
are summed over the stages that hold them (per DP column, one small group: Megatron's embedding group), so one
optimizer step keeps them bitwise equal. The gradient norm counts the weight once, on its first holder's stage.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from holmes_lightning.planner import Plan

Holder = tuple[int, str]  # (pipeline layer index, the parameter's name in that layer)


@dataclass(frozen=True)
class Tie:
    """One parameter that several pipeline layers hold, by (layer, name), the first holder first."""

    holders: tuple[Holder, ...]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(layer for layer, _ in self.holders))

    def stages(self, plan: Plan) -> tuple[int, ...]:
        """The stages holding it, in order (the first holder's first)."""
        stage_of = {layer: stage.index for stage in plan.stages for layer in stage.layers}
        return tuple(
            sorted({stage_of[layer] for layer in self.layers}, key=lambda s: (s != stage_of[self.layers[0]], s))
        )


def find_ties(layers: Sequence[nn.Module]) -> list[Tie]:
    """Every parameter held by more than one pipeline layer, in the order of its first holder."""
    holders: dict[int, list[Holder]] = defaultdict(list)
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters(remove_duplicate=False):
            holders[id(param)].append((index, name))
    return [Tie(tuple(found)) for found in holders.values() if len({layer for layer, _ in found}) > 1]


def across_stages(ties: Sequence[Tie], plan: Plan) -> list[Tie]:
    """The ties whose holders sit on more than one stage of `plan`."""
    return [tie for tie in ties if len(tie.stages(plan)) > 1] if plan.is_pipelined else []


def relink(layers: Sequence[nn.Module], ties: Sequence[Tie], owned: set[int]) -> None:
    """Make every owned holder of a tie hold its first owned holder's parameter again (allocating each layer on its
    own gives each holder a parameter of its own)."""
    for tie in ties:
        mine = [(layer, name) for layer, name in tie.holders if layer in owned]
        if len(mine) < 2:
            continue
        first = layers[mine[0][0]].get_parameter(mine[0][1])
        for layer, name in mine[1:]:
            owner, _, attribute = name.rpartition(".")
            setattr(layers[layer].get_submodule(owner), attribute, first)


def later_holders(ties: Sequence[Tie], owned: set[int]) -> dict[int, set[str]]:
    """Per owned layer, the names of its tied parameters an earlier owned layer holds too (they take its values)."""
    later: dict[int, set[str]] = defaultdict(set)
    for tie in ties:
        mine = [(layer, name) for layer, name in tie.holders if layer in owned]
        for layer, name in mine[1:]:
            if layer != mine[0][0]:
                later[layer].add(name)
    return later


class TiedCopies:
    """This rank's copies of the weights tied across stages (`across_stages`), and the groups that keep them equal
    (`groups[t]`: tie t's group in this rank's DP column, where this rank holds a copy)."""

    def __init__(
        self,
        across: Sequence[Tie],
        layers: Sequence[nn.Module],
        owned: set[int],
        groups: Mapping[int, dist.ProcessGroup],
    ) -> None:
        self.copies: list[tuple[nn.Parameter, dist.ProcessGroup, bool]] = []  # (parameter, group, holds the first)
        for index, tie in enumerate(across):
            mine = [(layer, name) for layer, name in tie.holders if layer in owned]
            if mine and index in groups:
                first_here = mine[0] == tie.holders[0]
                self.copies.append((layers[mine[0][0]].get_parameter(mine[0][1]), groups[index], first_here))

    @property
    def duplicates(self) -> set[int]:
        """`id()`s of the copies whose first holder is on another stage: the gradient norm leaves them out."""
        return {id(param) for param, _, first in self.copies if not first}

    @torch.no_grad()
    def broadcast_values(self) -> None:
        """Every copy takes the first holder's values (its stage is rank 0 of each group)."""
        for param, group, _ in self.copies:
            dist.broadcast(_local(param), group=group, group_src=0)

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Each copy's gradient becomes the sum of all copies' (after the DP sync, so each is already averaged)."""
        for param, group, _ in self.copies:
            if param.grad is not None:
                dist.all_reduce(_local(param.grad), group=group)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (copies on each stage are sharded alike), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
