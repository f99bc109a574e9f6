"""What flows between pipeline layers, for measuring them: one tensor or a tuple of tensors (e.g. hidden states, the
padding mask and position ids), samples first. A layer is called with the previous output unpacked."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

Flow = torch.Tensor | tuple[torch.Tensor, ...]  # a layer's input or output


def as_tuple(flow: Flow) -> tuple[torch.Tensor, ...]:
    return flow if isinstance(flow, tuple) else (flow,)


def apply(layer: nn.Module, flow: Flow) -> Flow:
    """`layer` on `flow`: a tuple is passed as several arguments. Its output must flow on the same way."""
    out = layer(*as_tuple(flow))
    if not all(isinstance(t, torch.Tensor) for t in (out if isinstance(out, tuple) else (out,))):
        kinds = ", ".join(type(t).__name__ for t in out) if isinstance(out, tuple) else type(out).__name__
        raise TypeError(
            f"pipeline layer {type(layer).__name__} returned {kinds}: a pipeline layer hands the next one a tensor or "
            f"a tuple of tensors (samples first), the only things a pipeline stage sends; return those alone"
        )
    return out


def detached(flow: Flow, *, requires_grad: bool = False) -> Flow:
    """`flow` cut from its graph; floating tensors then require gradients when asked (a layer's input)."""
    tensors = tuple(t.detach().requires_grad_(requires_grad and t.is_floating_point()) for t in as_tuple(flow))
    return tensors if isinstance(flow, tuple) else tensors[0]


def backward(flow: Flow) -> None:
    """Backward from every floating output that needs a gradient, with a gradient of ones."""
    outputs = [t for t in as_tuple(flow) if t.requires_grad]
    torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


def input_gradients(flow: Flow, inputs: Flow) -> None:
    """The backward of `backward` as far as the floating `inputs` only (no weight gradients), the graph kept."""
    outputs = [t for t in as_tuple(flow) if t.requires_grad]
    wanted = [t for t in as_tuple(inputs) if t.requires_grad]
    if outputs and wanted:
        grad_outputs = [torch.ones_like(t) for t in outputs]
        torch.autograd.grad(outputs, wanted, grad_outputs, retain_graph=True, allow_unused=True)


def nbytes(flow: Flow) -> int:
    return sum(t.numel() * t.element_size() for t in as_tuple(flow))


def samples(flow: Flow, count: int) -> Flow:
    """The first `count` samples of every tensor."""
    tensors = tuple(t[:count] for t in as_tuple(flow))
    return tensors if isinstance(flow, tuple) else tensors[0]


def repeated(flow: Flow, count: int) -> Flow:
    """A batch of `count` copies of the one sample in `flow`."""
    tensors = tuple(t.expand(count, *t.shape[1:]).contiguous() for t in as_tuple(flow))
    return tensors if isinstance(flow, tuple) else tensors[0]


def moved(flow: Flow, device: torch.device | str) -> Flow:
    tensors = tuple(t.to(device) for t in as_tuple(flow))
    return tensors if isinstance(flow, tuple) else tensors[0]


def shapes(flow: Flow) -> Sequence[list]:
    """Per tensor: its shape per sample and dtype (what a layer's cost depends on besides the layer)."""
    return [[list(t.shape[1:]), str(t.dtype)] for t in as_tuple(flow)]


Kept = list[tuple[torch.Tensor, torch.Tensor]]  # buffers and copies of their values


def buffer_values(modules: Sequence[nn.Module]) -> Kept:
    """Every buffer of `modules` with a copy of its value, for `restore_buffers`."""
    return [(b, b.clone()) for module in modules for b in module.buffers() if not b.is_meta]


def restore_buffers(kept: Kept) -> None:
    """Set the buffers back to the values kept. Forwards run only to measure layers (or, in torch's pipelining, to
    infer shapes on empty tensors) then leave running statistics (BatchNorm's) as they were. Only those that changed
    are written: one an autograd graph still holds must keep its version."""
    with torch.no_grad():
        for buffer, value in kept:
            if not torch.equal(buffer, value):
                buffer.copy_(value)


@contextmanager
def buffers_kept(modules: Sequence[nn.Module]) -> Iterator[None]:
    """`restore_buffers` on exit for the buffers of `modules` on entry."""
    kept = buffer_values(modules)
    try:
        yield
    finally:
        restore_buffers(kept)
