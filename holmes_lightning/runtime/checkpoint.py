"""Sharded checkpoints with torch.distributed.checkpoint: each rank writes its own stage's shards, published atomically.

A checkpoint is a directory: DCP's shards and `.metadata`, Lightning's loop/callback state in `meta.pt`, and the
`plan.json` that wrote it. Parameters and optimizer state are keyed by their names in the LightningModule (the
optimizer state flattened per parameter), so a stage's keys are its own and loading needs no gather.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from holmes_lightning.planner import Plan

PLAN_FILE = "plan.json"
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(ValueError):
    """A checkpoint that this run cannot resume from; the message says why and what to do."""


def model_state(module: nn.Module) -> dict[str, Any]:
    return get_model_state_dict(module, options=OPTIONS)


def optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    return get_optimizer_state_dict(module, optimizer, options=OPTIONS)


def save(checkpoint: dict[str, Any], path: Path, plan: Plan, is_global_zero: bool, barrier: Callable[[], None]) -> None:
    """Write into a hidden staging directory next to `path`, then rename it to `path` (every rank calls this)."""
    staging = path.with_name(f".{path.name}.partial")
    if is_global_zero:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    dcp.save(state, checkpoint_id=staging)
    if is_global_zero:
        torch.save(checkpoint, staging / _METADATA_FILENAME)
        (staging / PLAN_FILE).write_text(plan.to_json())
        _publish(staging, path)
    barrier()


def _publish(staging: Path, path: Path) -> None:
    """Replace `path` by `staging`; a crash in between leaves the previous copy complete under `.NAME.old`."""
    previous = path.with_name(f".{path.name}.old")
    shutil.rmtree(previous, ignore_errors=True)
    if path.is_file():
        path.unlink()
    elif path.exists():
        path.rename(previous)
    staging.rename(path)
    shutil.rmtree(previous, ignore_errors=True)


def load(path: Path, module: nn.Module, optimizers: Sequence[Optimizer], plan: Plan, strict: bool) -> dict[str, Any]:
    """Load this rank's shards into `module` and `optimizers`; returns the rest of Lightning's checkpoint."""
    if not (path / PLAN_FILE).is_file() or not (path / _METADATA_FILENAME).is_file():
        raise CheckpointError(
            f"ckpt_path={str(path)!r} is not a complete HolmesStrategy checkpoint (a directory with {PLAN_FILE}, "
            f"{_METADATA_FILENAME} and DCP shards); pass a directory that ModelCheckpoint wrote under HolmesStrategy"
        )
    saved = Plan.from_json((path / PLAN_FILE).read_text())
    check_resumable(saved, plan, path)
    state: dict[str, Any] = {"state_dict": model_state(module)}
    state.update({f"optimizer_{i}": optimizer_state(module, opt) for i, opt in enumerate(optimizers)})
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state["state_dict"], options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(module, optimizer, state[f"optimizer_{i}"], options=OPTIONS)
    return torch.load(path / _METADATA_FILENAME, weights_only=False)


def check_resumable(saved: Plan, plan: Plan, path: Path) -> None:
    """Shards are keyed by parameter name, so any plan over the same layers can read them."""
    if saved.num_layers != plan.num_layers:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds a model of {saved.num_layers} pipeline layers, this run has "
            f"{plan.num_layers}; resume with the same model"
        )
