"""Sharded checkpoints with torch.distributed.checkpoint: each rank writes its own stage's shards, published atomically.

A checkpoint is a directory: DCP's shards and `.metadata`, Lightning's loop/callback state in `meta.pt`, the
`plan.json` that wrote it, each rank's random-number state in `rng_rank<N>.pt`, and `complete.json`, written last.
Everything is written into a hidden staging directory that is renamed to the checkpoint's name only once every rank
finished, so a crash while saving leaves the checkpoints already published untouched. Parameters and optimizer state
are keyed by their names in the LightningModule (the optimizer state flattened per parameter), so a stage's keys are
its own and loading needs no gather, on any plan over the same layers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.seed import _collect_rng_states
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
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
COMPLETE_FILE = "complete.json"
DCP_METADATA_FILE = ".metadata"
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(ValueError):
    """A checkpoint that this run cannot resume from; the message says why and what to do."""


def model_state(module: nn.Module) -> dict[str, Any]:
    return get_model_state_dict(module, options=OPTIONS)


def optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    return get_optimizer_state_dict(module, optimizer, options=OPTIONS)


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def save(
    checkpoint: dict[str, Any],
    path: Path,
    plan: Plan,
    rank: int,
    is_global_zero: bool,
    barrier: Callable[[], None],
) -> None:
    """Write into a hidden staging directory next to `path`, then rename it to `path` (every rank calls this)."""
    staging = _hidden(path, "partial")
    if is_global_zero:
        for stale in path.parent.glob(".*.partial"):  # left by a save that crashed; one job writes a directory
            shutil.rmtree(stale, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    torch.save(_collect_rng_states(), staging / rng_file(rank))
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    dcp.save(state, checkpoint_id=staging)  # returns on rank 0 once every rank's shards are written
    if is_global_zero:
        torch.save(checkpoint, staging / _METADATA_FILENAME)
        (staging / PLAN_FILE).write_text(plan.to_json())
        step, epoch = checkpoint.get("global_step"), checkpoint.get("epoch")
        summary = {"global_step": step, "epoch": epoch, "world_size": plan.world_size}
        (staging / COMPLETE_FILE).write_text(json.dumps(summary))  # last: a directory without it is not a checkpoint
        _publish(staging, path)
    barrier()


def _hidden(path: Path, suffix: str) -> Path:
    return path.with_name(f".{path.name}.{suffix}")


def _publish(staging: Path, path: Path) -> None:
    """Replace `path` by `staging`; a crash in between leaves the previous copy complete under `.NAME.old`."""
    previous = _hidden(path, "old")
    shutil.rmtree(previous, ignore_errors=True)
    if path.is_file():
        path.unlink()
    elif path.exists():
        path.rename(previous)
    staging.rename(path)
    shutil.rmtree(previous, ignore_errors=True)


def remove(path: Path) -> None:
    """Unpublish by rename first, so a crash while deleting never leaves a half-deleted checkpoint under its name."""
    if not path.exists():
        return
    doomed = _hidden(path, "deleting")
    shutil.rmtree(doomed, ignore_errors=True)
    path.rename(doomed)
    shutil.rmtree(doomed)


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in `directory` (highest step), or None if it holds none."""
    found = []
    for candidate in Path(directory).glob("[!.]*"):
        try:
            summary = json.loads((candidate / COMPLETE_FILE).read_text())
        except (OSError, ValueError):
            continue
        found.append((summary.get("global_step") or 0, candidate.stat().st_mtime, candidate))
    return max(found)[2] if found else None


def check(path: str | Path, plan: Plan | None = None, hyperparameters: Mapping[str, Any] | None = None) -> Path:
    """Stop early on a checkpoint that cannot be resumed: missing, incomplete, corrupt, or from another model.

    Reads only metadata (no process group): DCP's `.metadata`, the size of every shard file it names, `meta.pt`
    and `plan.json`. `plan`: this run's (same number of pipeline layers); `hyperparameters`: values the
    LightningModule saved with `save_hyperparameters()` that must match (e.g. the model's shape).
    """
    path = Path(path)
    where = f"checkpoint {str(path)!r}"
    if not path.is_dir():
        raise CheckpointError(f"resume={str(path)!r}: no such checkpoint directory; {_choices(path.parent)}")
    if not (path / COMPLETE_FILE).is_file():
        raise CheckpointError(
            f"{where} is incomplete (no {COMPLETE_FILE}: its save did not finish, or another tool wrote it); "
            f"{_choices(path.parent)}"
        )
    saved_plan = _read(path, PLAN_FILE, lambda file: Plan.from_json(file.read_text()))
    meta = _read(path, _METADATA_FILENAME, lambda file: torch.load(file, weights_only=False, map_location="cpu"))
    metadata = _read(path, DCP_METADATA_FILE, lambda _file: dcp.FileSystemReader(path).read_metadata())
    needed: dict[str, int] = {}
    for item in metadata.storage_data.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        file = path / name
        have = file.stat().st_size if file.is_file() else None
        if have is None or have < size:
            state = "is missing" if have is None else f"has {have} of its {size} bytes"
            raise CheckpointError(f"{where} is corrupt: shard {name} {state}; {_choices(path.parent, path)}")
    if plan is not None:
        check_resumable(saved_plan, plan, path)
    saved = meta.get("hyper_parameters") or {}
    expected = hyperparameters or {}
    changed = [f"{k}={saved[k]!r} there, {v!r} here" for k, v in expected.items() if k in saved and saved[k] != v]
    if changed:
        raise CheckpointError(f"{where} holds another model ({'; '.join(changed)}); resume with the same settings")
    return path


def _read(path: Path, name: str, reader: Callable[[Path], Any]) -> Any:
    try:
        return reader(path / name)
    except Exception as err:  # truncated pickles, bad JSON, missing files: all mean this copy cannot be used
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt: {name} is unreadable ({type(err).__name__}: {err}); "
            f"{_choices(path.parent, path)}"
        ) from err


def _choices(directory: Path, exclude: Path | None = None) -> str:
    others = sorted(p.name for p in directory.glob("[!.]*") if (p / COMPLETE_FILE).is_file() and p != exclude)
    if not others:
        return "start without resume (resume=null)"
    return f"resume from another checkpoint in {str(directory)!r} ({', '.join(others)}), or resume=auto for the newest"


def load(
    path: Path, module: nn.Module, optimizers: Sequence[Optimizer], plan: Plan, rank: int, strict: bool
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Load this rank's shards into `module` and `optimizers`.

    Returns the rest of Lightning's checkpoint and this rank's saved random-number state (None when the checkpoint
    came from a job of another size, whose rank numbers mean other stages).
    """
    if not (path / PLAN_FILE).is_file() or not (path / _METADATA_FILENAME).is_file():
        raise CheckpointError(
            f"ckpt_path={str(path)!r} is not a complete HolmesStrategy checkpoint (a directory with {PLAN_FILE}, "
            f"{_METADATA_FILENAME} and DCP shards); pass a directory that ModelCheckpoint wrote under HolmesStrategy"
        )
    saved = Plan.from_json((path / PLAN_FILE).read_text())
    check_resumable(saved, plan, path)
    state: dict[str, Any] = {"state_dict": model_state(module)}
    state.update({f"optimizer_{i}": optimizer_state(module, opt) for i, opt in enumerate(optimizers)})
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as err:  # raised on every rank alike: DCP plans the load collectively
        cause = next(iter(err.failures.values()))[0]
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit this model ({cause}); resume with the model and optimizer it "
            f"was saved from, or start without resume"
        ) from err
    set_model_state_dict(module, state["state_dict"], options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(module, optimizer, state[f"optimizer_{i}"], options=OPTIONS)
    rng = path / rng_file(rank)
    same_job = saved.world_size == plan.world_size and rng.is_file()
    return torch.load(path / _METADATA_FILENAME, weights_only=False), torch.load(
        rng, weights_only=False
    ) if same_job else None


def check_resumable(saved: Plan, plan: Plan, path: Path) -> None:
    """Shards are keyed by parameter name, so any plan over the same layers can read them."""
    if saved.num_layers != plan.num_layers:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds a model of {saved.num_layers} pipeline layers, this run has "
            f"{plan.num_layers}; resume with the same model"
        )
