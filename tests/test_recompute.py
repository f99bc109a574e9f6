"""Activation checkpointing of pipeline layers: a checkpointed layer runs its forward again in backward, keeps less
for it, and gives the same gradients, dropout included."""

from __future__ import annotations

import torch
from torch import nn

from holmes_lightning.planner import Checkpointing
from holmes_lightning.runtime.recompute import checkpoint_layers


class Counted(nn.Module):
    """Linear, GELU and dropout; counts how often its forward runs."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear, self.dropout, self.runs = nn.Linear(width, width), nn.Dropout(0.3), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return self.dropout(nn.functional.gelu(self.linear(x)))


def layers_and_grads(choice: Checkpointing) -> tuple[list[Counted], list[torch.Tensor], int]:
    """Four layers (the last two owned and checkpointed as `choice` says) after one forward and backward: the
    gradients and the bytes autograd saved."""
    torch.manual_seed(0)
    layers = [Counted(16) for _ in range(4)]
    checkpoint_layers(layers, owned=[2, 3], choice=choice)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
        x = torch.randn(8, 16, requires_grad=True)
        for layer in layers:
            x = layer(x)
    x.sum().backward()
    return layers, [p.grad for layer in layers for p in layer.parameters()], sum(saved)


def test_checkpointed_layers_run_their_forward_again_and_give_the_same_gradients():
    plain, plain_grads, plain_bytes = layers_and_grads(Checkpointing.off)
    full, full_grads, full_bytes = layers_and_grads(Checkpointing.full)
    selective, selective_grads, selective_bytes = layers_and_grads(Checkpointing.selective)
    assert [layer.runs for layer in plain] == [1, 1, 1, 1]
    assert [layer.runs for layer in full] == [1, 1, 2, 2]  # owned and checkpointed: again in backward
    assert [layer.runs for layer in selective] == [1, 1, 1, 2]  # odd positions only
    for grads in (full_grads, selective_grads):  # the same dropout masks the second time
        assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads, strict=True))
    assert full_bytes < selective_bytes < plain_bytes
    names = [name for name, _ in full[2].named_parameters()]
    assert type(full[2]) is Counted and names == ["linear.weight", "linear.bias"]  # the same module, names kept
