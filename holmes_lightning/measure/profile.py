"""Profile what the planner plans with: pipeline layers on one micro-batch (FLOPs with FlopCounterMode, bytes from
tensors, optional timing). It feeds the pure-Python planner and is never imported by it.

Layers on the meta device (a model too big for one rank) are profiled on meta tensors: FLOPs and bytes come from
shapes alone, nothing is allocated. Their stash counts attention as the devices' fused kernel keeps it
(`FusedAttention`), not as torch's math path, which meta tensors take.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.flop_counter import FlopCounterMode

from holmes_lightning.measure.layer_io import (
    Flow,
    apply,
    as_tuple,
    backward,
    buffers_kept,
    detached,
    input_gradients,
    moved,
    nbytes,
    repeated,
)
from holmes_lightning.planner.profile import LayerProfile, ModelProfile


def profile_modules(
    modules: Sequence[nn.Module], sample: Flow, name: str = "model", time_repeats: int = 0
) -> ModelProfile:
    """Profile `modules` applied in sequence to one micro-batch `sample` (samples first; a tuple of tensors is the
    first layer's several inputs).

    `time_repeats > 0` also times each layer's forward and backward (median of that many runs) on this machine;
    the seconds then stand for the topology's fastest device (`measured_tflops=None`). On meta layers the sample
    moves to the meta device and nothing is timed.
    """
    layers, tokens = measure_layers(list(modules), sample, time_repeats)
    inputs = nbytes(sample) / as_tuple(sample)[0].shape[0]
    return ModelProfile(name, tuple(layers), tokens_per_sample=tokens, input_bytes=inputs)


def measure_layers(modules: list[nn.Module], sample: Flow, time_repeats: int = 0) -> tuple[list[LayerProfile], int]:
    """Per-sample profiles of `modules` applied in order to `sample` (batch first), and the tokens per sample (the
    first input's elements per sample: token ids).

    The last layer's stash also counts two tensors of its output's size: the output itself, which the pipeline keeps
    for the loss, and what the loss keeps for its backward (cross-entropy's log-probabilities).
    """
    if not modules:
        raise ValueError("profile_modules: the module list is empty; pass the model's pipeline_layers()")
    on_meta = any(p.is_meta for module in modules for p in module.parameters())
    if on_meta:
        sample, time_repeats = moved(sample, "meta"), 0
    first = as_tuple(sample)[0]
    if first.shape[0] == 1:  # a layer normalising over the batch (BatchNorm) trains on more than one value a channel
        sample = repeated(sample, 2)
    with buffers_kept(modules):  # the forwards here leave running statistics (BatchNorm's) as they were
        layers = _measured(modules, sample, on_meta, time_repeats)
    return layers, first[0].numel()


def _measured(modules: list[nn.Module], sample: Flow, on_meta: bool, time_repeats: int) -> list[LayerProfile]:
    """`measure_layers`' profiles, per sample of the batch `sample`."""
    batch = as_tuple(sample)[0].shape[0]
    layers = []
    x = sample
    for index, module in enumerate(modules):
        inputs = detached(x, requires_grad=True)
        try:
            forward_flops, backward_flops, input_flops, stash, out = _count(module, inputs, on_meta=on_meta)
        except (NotImplementedError, RuntimeError) as error:
            if not on_meta:
                raise
            raise RuntimeError(
                f"profiling layer {index} ({type(module).__name__}) on the meta device failed: {error}. A layer that "
                f"reads its values (e.g. .item(), boolean masks) cannot run on meta tensors; pass "
                f"HolmesStrategy(profile=ModelProfile(...)) or build the model on a real device"
            ) from error
        seconds = _time(module, inputs, time_repeats) if time_repeats > 0 else (None, None)
        param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        frozen_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad)
        output_bytes = nbytes(out)
        if index == len(modules) - 1:
            stash += 2 * output_bytes
        layers.append(
            LayerProfile(
                name=f"{index}:{type(module).__name__}",
                forward_flops=forward_flops / batch,
                backward_flops=backward_flops / batch,
                param_bytes=float(param_bytes),
                activation_bytes=output_bytes / batch,
                stash_bytes=stash / batch,
                forward_s=None if seconds[0] is None else seconds[0] / batch,
                backward_s=None if seconds[1] is None else seconds[1] / batch,
                weight_flops=(backward_flops - input_flops) / batch,
                frozen_bytes=float(frozen_bytes),
            )
        )
        x = detached(out)
    return layers


def _count(module: nn.Module, inputs: Flow, *, on_meta: bool) -> tuple[float, float, float, float, Flow]:
    """Forward FLOPs, backward FLOPs, of those the input gradients' (the rest computes weight gradients), bytes
    autograd saves for backward (parameters excluded), and the output.

    Saved tensors count once per storage they hold (views of one tensor share it), which also works on meta tensors.
    On meta, the saved bytes come from a second forward with attention as the fused kernel runs it (`FusedAttention`);
    the FLOPs stay those of the first (torch's math path: FlopCounterMode counts no CPU fused attention).
    """
    params = {StorageWeakRef(p.untyped_storage()) for p in module.parameters()}
    saved: dict[StorageWeakRef, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = StorageWeakRef(tensor.untyped_storage())
        if storage not in params:
            saved[storage] = tensor.untyped_storage().nbytes()
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with torch.enable_grad(), hooks, FlopCounterMode(display=False) as forward_counter:
        out = apply(module, inputs)
    with FlopCounterMode(display=False) as input_counter:
        input_gradients(out, inputs)
    with FlopCounterMode(display=False) as backward_counter:
        backward(out)
    module.zero_grad(set_to_none=True)
    if on_meta:
        saved.clear()
        with torch.enable_grad(), hooks, FusedAttention():
            apply(module, inputs)
    flops = forward_counter.get_total_flops(), backward_counter.get_total_flops(), input_counter.get_total_flops()
    return *flops, float(sum(saved.values())), out


class FusedAttention(TorchFunctionMode):
    """`scaled_dot_product_attention` on meta tensors as CPU's fused kernel runs it without dropout.

    Meta tensors take torch's math path, which keeps the s x s attention probabilities for backward (a GPT block of
    seq 512, width 256: 13.6 MB per sequence instead of 8.4 MB). The fused kernels that CPU (flash) and CUDA (flash,
    memory-efficient) run keep only query, key, value, output and the log-sum-exp. With dropout, CPU runs the math
    path: left to it.
    """

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].is_meta:
            return _flash_attention(func, *args, **kwargs)
        return func(*args, **kwargs)


def _flash_attention(
    func: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """CPU's flash attention (grouped query heads included), or `func` itself where CPU runs the math path: with
    dropout, or arguments its flash kernel refuses."""
    if dropout_p == 0:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        try:
            return flash(query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]
        except RuntimeError:
            pass
    return func(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def _time(module: nn.Module, inputs: Flow, repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds over `repeats` runs, after one warm-up run."""
    forwards, backwards = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        with torch.enable_grad():
            out = apply(module, inputs)
        middle = time.perf_counter()
        backward(out)
        forwards.append(middle - start)
        backwards.append(time.perf_counter() - middle)
    module.zero_grad(set_to_none=True)
    return statistics.median(forwards[1:]), statistics.median(backwards[1:])


def first_sample(loader: Iterable) -> object:
    """One sample of `loader` as its batches come (collated, batch of one), without iterating it when possible.

    A DataLoader over a map-style dataset collates `dataset[0]` (no sampler, workers or random draws); any other
    iterable gives its first batch.
    """
    if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset):
        return loader.collate_fn([loader.dataset[0]])
    return next(iter(loader))
