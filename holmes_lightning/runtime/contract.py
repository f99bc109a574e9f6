"""What a LightningModule must be for HolmesStrategy to pipeline it, and the batches it takes.

- `pipeline_layers()`: its layers in order. Layer k+1 is called with layer k's output, a tuple unpacked into several
  arguments (e.g. hidden states, the padding mask and position ids); the first layer with the batch's inputs.
- `pipeline_loss(outputs, targets)`: the mean loss of one micro-batch. With `pipeline_loss_weight(targets)` (how
  many units that mean is over, e.g. the tokens not ignored) a step's loss is weighted by it across micro-batches and
  replicas: the loss of the whole global batch, as one process computes it.
- Batches: `(inputs, targets)` (two tensors, samples first), or a dict as HF's collators make it: `input_ids`,
  `labels`, optionally `attention_mask` and `position_ids`; the first layer then gets
  `(input_ids, attention_mask, position_ids)`, an absent mask as ones and absent positions as `0..T-1` (HF's defaults).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

CONTRACT = ("pipeline_layers", "pipeline_loss")
DICT_INPUTS = ("input_ids", "attention_mask", "position_ids")
DICT_TARGETS = "labels"
Inputs = tuple[torch.Tensor, ...]  # the first layer's arguments
LossWeight = Callable[[torch.Tensor], torch.Tensor]


class ContractError(TypeError):
    """The LightningModule cannot be split into pipeline stages; the message says what to add."""


def missing_contract(module: nn.Module) -> list[str]:
    return [name for name in CONTRACT if not callable(getattr(module, name, None))]


def loss_weight(module: nn.Module) -> LossWeight | None:
    """The module's `pipeline_loss_weight`, if it weighs its micro-batches' losses."""
    weight = getattr(module, "pipeline_loss_weight", None)
    return weight if callable(weight) else None


def check_contract(module: nn.Module, pp: int) -> None:
    missing = missing_contract(module)
    if missing:
        raise ContractError(
            f"HolmesStrategy with pp={pp} pipeline stages needs {type(module).__name__} to define "
            f"{' and '.join(missing)}: add `def pipeline_layers(self) -> list[nn.Module]` (ordered modules whose "
            f"sequential application maps inputs to outputs) and `def pipeline_loss(self, outputs, targets) -> "
            f"Tensor` (mean loss of one micro-batch); batches are (inputs, targets) or dicts of input_ids and labels. "
            f"Or train with pp=1."
        )


def check_uncompiled(layers: Sequence[nn.Module | None], schedule: str) -> None:
    """Refuse torch.compile'd layers under a schedule that splits backwards (torch's split backward cannot run them)."""
    compiled = [
        index
        for index, layer in enumerate(layers)
        if layer is not None and any(isinstance(m, OptimizedModule) for m in layer.modules())
    ]
    if compiled:
        raise ValueError(
            f"schedule {schedule} runs each backward as separate input- and weight-gradient passes, which torch "
            f"cannot run through torch.compile'd modules (pipeline layers {compiled}); use schedule=Interleaved1F1B "
            f"or 1F1B with the compiled layers, or pass the layers uncompiled"
        )


def check_automatic_optimization(module: nn.Module, pipeline: str) -> None:
    if not module.automatic_optimization:
        raise ValueError(
            f"HolmesStrategy with {pipeline} needs Lightning's automatic optimization: the pipeline schedule runs "
            f"forward and backward itself, and Lightning steps the optimizers, clips and accumulates around it; remove "
            f"`self.automatic_optimization = False` from {type(module).__name__} (and its manual optimizer calls), "
            f"or train without a pipeline: HolmesStrategy(pp=1) with a schedule that is not interleaved"
        )


def check_precision(precision: str) -> None:
    """Refuse fp16 with loss scaling: Lightning's GradScaler is not sharding-aware."""
    if precision == "16-mixed":
        raise ValueError(
            "HolmesStrategy cannot train with precision='16-mixed': its GradScaler is not sharding-aware (each "
            "FSDP shard and pipeline stage would check for inf/NaN and skip steps on its own); use "
            "precision='bf16-mixed' (no loss scaling needed) or '32-true'"
        )


def split_batch(batch: object) -> tuple[Inputs, torch.Tensor]:
    """A training or evaluation batch as the first layer's inputs and the loss's targets."""
    if isinstance(batch, Mapping):
        if DICT_TARGETS not in batch:
            raise ContractError(
                f"a dict batch needs {DICT_TARGETS!r} for the loss; got keys {sorted(batch)}; add the labels (HF's "
                f"DataCollatorForLanguageModeling(mlm=False) does), or yield (inputs, targets)"
            )
        return dict_inputs(batch), batch[DICT_TARGETS]
    if isinstance(batch, tuple | list) and len(batch) == 2 and torch.is_tensor(batch[1]):
        inputs = _tensors(batch[0])
        if inputs is not None:
            return inputs, batch[1]
    raise ContractError(
        f"HolmesStrategy pipelines batches of the form (inputs, targets), tensors with the samples first (inputs may "
        f"be several, a tuple the first layer takes as its arguments), or dicts of input_ids and labels (optionally "
        f"attention_mask, position_ids); got {type(batch).__name__}; make the DataLoader yield one of these"
    )


def _tensors(inputs: object) -> Inputs | None:
    """A batch's inputs as the first layer's arguments: one tensor, or a tuple or list of them (None: neither)."""
    if torch.is_tensor(inputs):
        return (inputs,)
    if isinstance(inputs, tuple | list) and inputs and all(torch.is_tensor(t) for t in inputs):
        return tuple(inputs)
    return None


def prediction_inputs(batch: object) -> Inputs:
    """The inputs of a predict batch: a tensor, (inputs,) or (inputs, targets) (inputs a tensor or a tuple of them),
    or a dict (its labels unused)."""
    if torch.is_tensor(batch):
        return (batch,)
    if isinstance(batch, Mapping):
        return dict_inputs(batch)
    if isinstance(batch, tuple | list) and len(batch) in (1, 2) and (inputs := _tensors(batch[0])) is not None:
        return inputs
    raise ContractError(
        f"HolmesStrategy predicts from batches that are an inputs tensor, (inputs,), (inputs, targets) or a dict of "
        f"input_ids, samples first; got {type(batch).__name__}; make the predict DataLoader yield one of these"
    )


def dict_inputs(batch: Mapping[str, torch.Tensor]) -> Inputs:
    """`(input_ids, attention_mask, position_ids)` of a dict batch, absent ones as HF's model forward makes them."""
    unknown = sorted(set(batch) - {*DICT_INPUTS, DICT_TARGETS})
    if "input_ids" not in batch or unknown:
        raise ContractError(
            f"a dict batch holds input_ids, labels and optionally attention_mask, position_ids; got keys "
            f"{sorted(batch)}; drop {unknown or 'nothing'}{'' if 'input_ids' in batch else ', add input_ids'} in the "
            f"DataLoader's collate_fn"
        )
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    positions = batch.get("position_ids")
    if mask is None:
        mask = torch.ones_like(ids)
    if positions is None:
        positions = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids).contiguous()
    return ids, mask, positions


def keep_owned_layers(module: nn.Module, layers: Sequence[nn.Module], owned: set[int]) -> None:
    """Detach the layers this rank does not own from `module`: its parameters, optimizer and checkpoint skip them. A
    module that several layers apply (one block shared by many, as ALBERT shares one) stays where this rank owns one
    of them."""
    # every place each module is registered, as (parent's path, name): `[block] * n` in a ModuleList has n places
    places: defaultdict[int, list[tuple[str, str]]] = defaultdict(list)
    for path, child in module.named_modules(remove_duplicate=False):
        if path:  # not `module` itself
            parent, _, name = path.rpartition(".")
            places[id(child)].append((parent, name))
    kept_modules = {id(layers[index]) for index in owned}
    for index, layer in enumerate(layers):
        if id(layer) not in places:
            raise ContractError(
                f"pipeline_layers()[{index}] ({type(layer).__name__}) is not a submodule of {type(module).__name__}; "
                f"return the module's own layers (assigned as attributes or in an nn.ModuleList) so they train"
            )
    for layer in {id(layer): layer for layer in layers}.values():
        if id(layer) not in kept_modules:
            for parent, name in places[id(layer)]:
                setattr(module.get_submodule(parent), name, None)
    kept = {id(p) for i in owned for p in layers[i].parameters()}
    stray = [name for name, p in module.named_parameters() if id(p) not in kept]
    if stray:
        raise ContractError(
            f"parameters {stray[:5]} of {type(module).__name__} belong to no layer of this stage; every parameter "
            f"must live in one of pipeline_layers()"
        )
