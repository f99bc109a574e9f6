"""Lightning's weight-averaging callbacks (`WeightAveraging`, `EMAWeightAveraging`, `StochasticWeightAveraging`)
over this rank's part of the model.

The callbacks copy the whole LightningModule in their `setup`, before the strategy cuts it into stages and shards
them, and then pair that copy's parameters with the stage's in order: a shape error, or where shapes agree an average
of other layers' weights. `average_stage` makes their copies again from the assembled stage, so each rank averages its
own shards (copied through a plain module of the stage's tensors: FSDP's modules refuse `deepcopy`). The averages
are sharded like the model, so a checkpoint writes them through DCP with it (`sharded_states`) rather than into rank
0's metadata file, and a resume reads them back (`templates`, `restore`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from copy import deepcopy
from dataclasses import replace
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from torch import nn
from torch.optim.swa_utils import AveragedModel

from holmes_lightning.planner import PlanOptions

try:
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # Lightning < 2.6: no WeightAveraging (and EMAWeightAveraging) to look after
    WeightAveraging = ()  # type: ignore[assignment,misc]  # isinstance(x, ()) is False

AVERAGE_STATE = 1.0  # an averaged copy of the weights, per parameter byte
CURRENT_KEY = "current_model_state"  # WeightAveraging's: the trained weights, while "state_dict" holds the average
SWA_STATE = "average_model_state"  # StochasticWeightAveraging's average, in its callback state


def counted(options: PlanOptions, callbacks: Sequence[Callback], device: torch.device) -> PlanOptions:
    """The plan options with the averaged copies that the callbacks keep on `device` (the training device) counted in
    each rank's memory, per parameter byte as its optimizer states are (not the frozen weights' copies)."""
    copies = sum(
        isinstance(callback, (WeightAveraging, StochasticWeightAveraging))
        and torch.device(callback._device or device).type == device.type
        for callback in callbacks
    )
    return replace(options, state_multiplier=options.state_multiplier + copies * AVERAGE_STATE) if copies else options


def average_stage(callbacks: Sequence[Callback], module: pl.LightningModule) -> None:
    """Copy each averaging callback's model again from `module`, now this rank's stage (as the callback's `setup`
    copies it, with its own device, buffers and averaging arguments)."""
    for callback in callbacks:
        if isinstance(callback, WeightAveraging) and callback._average_model is not None:
            device = callback._device or module.device
            callback._average_model = AveragedModel(
                _tensors_of(module), device=device, use_buffers=callback._use_buffers, **callback._kwargs
            )
        elif isinstance(callback, StochasticWeightAveraging) and callback._average_model is not None:
            callback._average_model = deepcopy(_tensors_of(module))


def _tensors_of(module: nn.Module) -> nn.Module:
    """A plain module of `module`'s submodules' names holding its parameters and buffers (the same tensors, in the
    same order and state-dict names), to copy without FSDP's module classes."""
    plain = {"": nn.Module()}
    for name, _ in module.named_modules(remove_duplicate=False):  # in order: parameters() walks the same tree
        if name:
            parent, _, leaf = name.rpartition(".")
            plain[name] = nn.Module()
            plain[parent].add_module(leaf, plain[name])
    for name, parameter in module.named_parameters(remove_duplicate=False):
        parent, _, leaf = name.rpartition(".")
        plain[parent].register_parameter(leaf, parameter)
    for name, buffer in module.named_buffers(remove_duplicate=False):
        parent, _, leaf = name.rpartition(".")
        persistent = leaf not in module.get_submodule(parent)._non_persistent_buffers_set
        plain[parent].register_buffer(leaf, buffer, persistent=persistent)
    return plain[""]


def _swa_states(checkpoint: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """StochasticWeightAveraging's callback states in a Lightning checkpoint, each with the DCP key of its average."""
    states = checkpoint.get("callbacks", {}).values()
    swa = (state for state in states if isinstance(state, dict) and SWA_STATE in state)
    yield from ((f"swa_{index}", state) for index, state in enumerate(swa))


def sharded_states(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Take the averaging callbacks' sharded states out of Lightning's `checkpoint`, for DCP beside the model (an SWA
    average leaves its DCP key in its place)."""
    states = {}
    if CURRENT_KEY in checkpoint:
        states[CURRENT_KEY] = checkpoint.pop(CURRENT_KEY)
    for key, state in _swa_states(checkpoint):
        if state[SWA_STATE] is not None:
            states[key], state[SWA_STATE] = state[SWA_STATE], key
    return states


def templates(callbacks: Sequence[Callback], model_state: Mapping[str, Any]) -> dict[str, Callable[[], Any]]:
    """What makes the templates a checkpoint's averaging states load into, by their `sharded_states` keys (copies:
    loading one must not write the weights of the live model)."""
    found = {CURRENT_KEY: partial(_copy, model_state)}
    swa = [callback for callback in callbacks if isinstance(callback, StochasticWeightAveraging)]
    for index, callback in enumerate(swa):
        if callback._average_model is not None:
            found[f"swa_{index}"] = partial(_copy, callback._average_model.state_dict())
    return found


def restore(checkpoint: dict[str, Any], model_state: Mapping[str, Any]) -> None:
    """Put the averaging states that `checkpoint.load` returned under their `sharded_states` keys where the callbacks
    read them (WeightAveraging's average, loaded into the model as its "state_dict", back under that key)."""
    if CURRENT_KEY in checkpoint:
        checkpoint["state_dict"] = dict(model_state)
    for key, state in _swa_states(checkpoint):
        if state[SWA_STATE] == key:
            state[SWA_STATE] = checkpoint.pop(key)


def _copy(state: Mapping[str, Any]) -> dict[str, Any]:
    return {name: value.detach().clone() if isinstance(value, torch.Tensor) else value for name, value in state.items()}
