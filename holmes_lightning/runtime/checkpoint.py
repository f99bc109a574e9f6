"""Sharded checkpoints with torch.distributed.checkpoint: each rank writes its own stage's shards, published atomically.

A checkpoint is a directory in the layout of Lightning's own sharded checkpoints: the weights under DCP's "model" key,
each optimizer's state under "optimizer_<i>", Lightning's loop and callback state in `meta.pt` (so Lightning's
`python -m lightning.pytorch.utilities.consolidate_checkpoint` makes one file of it, which `load_from_checkpoint`
reads). Beside them: the `plan.json` that wrote it (with what that plan was made for under `made_for`, so a resume on
the same nodes can run it again: `runtime.stored_plan`), each rank's random-number state in `rng_rank<N>.pt`, and
`complete.json`, written last.
Everything is written into a hidden staging directory that is renamed to the checkpoint's name only once every rank
finished, so a crash while saving leaves the checkpoints already published untouched. Parameters and optimizer state
are keyed by their names in the LightningModule (the optimizer state flattened per parameter), so a stage's keys are
its own and loading needs no gather, on any plan over the same layers.

`complete.json` lists the SHA-256 of every other file (each rank hashes its share of them), so a shard damaged after
the save is refused by `check` and `load` with its name. The directory must be one that every node sees:
`check_shared` proves it at start.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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

import holmes_lightning.runtime.frozen as frozen
from holmes_lightning.planner import Plan

PLAN_FILE = "plan.json"
MADE_FOR = "made_for"  # plan.json's key for what the plan was made for; Plan.from_json ignores it
COMPLETE_FILE = "complete.json"
DCP_METADATA_FILE = ".metadata"
DIGEST = "sha256"
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
MODEL_KEY = "model"  # the weights' DCP key in Lightning's sharded checkpoints (FSDP, ModelParallel)
LEGACY_MODEL_KEY = "state_dict"  # earlier versions' key, which Lightning's consolidation does not read


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
    *,
    plan: Plan,
    rank: int,
    made_for: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    left_out: Mapping[str, Any] | None = None,
) -> None:
    """Write into a hidden staging directory next to `path`, then rename it to `path` (every rank calls this).

    `made_for`: what `plan` was made for (`stored_plan.PlanBasis.to_dict()`), written into plan.json beside it.
    `extra`: more state sharded as the model is (DiLoCo's outer parameters), written by DCP beside it.
    `left_out`: this rank's frozen weights that `checkpoint` lacks (None: it lacks none), recorded by their fingerprint
    (`frozen`), against which a resume checks the weights it built."""
    staging = _hidden(path, "partial")
    if rank == 0:
        for stale in path.parent.glob(".*.partial"):  # left by a save that crashed; one job writes a directory
            shutil.rmtree(stale, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    torch.save(_collect_rng_states(), staging / rng_file(rank))
    if left_out is not None:
        checkpoint[frozen.FINGERPRINT_KEY] = frozen.fingerprint(left_out, left_out.keys(), _gather)
    state = {MODEL_KEY: checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    state.update(extra or {})
    metadata = dcp.save(state, checkpoint_id=staging)  # returns once every rank's shards and `.metadata` are written
    written = [*_shard_files(metadata), DCP_METADATA_FILE, *(rng_file(r) for r in range(plan.world_size))]
    digests = {
        name: digest
        for share in _gather(_digests(staging, written, (rank, plan.world_size)))
        for name, digest in share.items()
    }
    if rank == 0:
        torch.save(checkpoint, staging / _METADATA_FILENAME)
        (staging / PLAN_FILE).write_text(plan_json(plan, made_for))
        digests.update(_digests(staging, [_METADATA_FILENAME, PLAN_FILE]))
        step, epoch = checkpoint.get("global_step"), checkpoint.get("epoch")
        summary = {
            "global_step": step,
            "epoch": epoch,
            "world_size": plan.world_size,
            DIGEST: dict(sorted(digests.items())),
        }
        (staging / COMPLETE_FILE).write_text(json.dumps(summary))  # last: a directory without it is not a checkpoint
        _publish(staging, path)
    _barrier()


def plan_json(plan: Plan, made_for: Mapping[str, Any] | None) -> str:
    """plan.json's text: the plan, and under `MADE_FOR` what it was made for (if known)."""
    data = json.loads(plan.to_json())
    if made_for is not None:
        data[MADE_FOR] = made_for
    return json.dumps(data, indent=2)


def stored_plan(path: str | Path) -> tuple[Plan, dict[str, Any] | None]:
    """The plan a checkpoint was saved on, and what it was made for (None: a checkpoint saved before that was kept)."""
    text = (Path(path) / PLAN_FILE).read_text()
    return Plan.from_json(text), json.loads(text).get(MADE_FOR)


def _barrier() -> None:
    """Wait for every rank (nothing to wait for without a process group: DCP then saves and loads on one process)."""
    if dist.is_initialized():
        dist.barrier()


def _gather(value: Any) -> list[Any]:
    """Every rank's `value`, by rank."""
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _shard_files(metadata: Any) -> list[str]:
    return sorted({item.relative_path for item in metadata.storage_data.values()})


def _file_digest(file: Path) -> str:
    digest = hashlib.new(DIGEST)
    with file.open("rb") as stream:
        while chunk := stream.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _digests(directory: Path, names: Sequence[str], share: tuple[int, int] = (0, 1)) -> dict[str, str]:
    """The digests of share (rank, world size) of `names`: every rank reads every world-size-th file, so once each."""
    rank, world_size = share
    return {name: _file_digest(directory / name) for name in names[rank::world_size]}


def _damaged(directory: Path, digests: Mapping[str, str], share: tuple[int, int] = (0, 1)) -> list[str]:
    """The files of this share of `digests` that are missing or whose contents changed since the save."""
    rank, world_size = share
    names = sorted(digests)[rank::world_size]
    return [
        name for name in names if not (directory / name).is_file() or _file_digest(directory / name) != digests[name]
    ]


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


def check_shared(directory: Path) -> None:
    """Every rank calls this at start: each writes a token into `directory`, which rank 0 must see, and every rank
    must list the same checkpoints there (else ranks would resume from different ones, or hang)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    names = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    directory.mkdir(parents=True, exist_ok=True)
    token = directory / f".shared-{names[0]}-rank{rank}"
    token.touch()
    reports = _gather((socket.gethostname(), published(directory)))  # every token is written once this returns
    problem = [None]
    if rank == 0:
        seen = {r for r in range(world_size) if (directory / f".shared-{names[0]}-rank{r}").is_file()}
        problem = [sharing_problem(directory, [host for host, _ in reports], seen, [names for _, names in reports])]
    dist.broadcast_object_list(problem, src=0)
    token.unlink(missing_ok=True)
    if problem[0] is not None:
        raise CheckpointError(problem[0])


def sharing_problem(
    directory: str | Path, hosts: Sequence[str], seen: Collection[int], listings: Sequence[Sequence[str]]
) -> str | None:
    """Why `directory` is not one directory that every rank shares (None when it is).

    `hosts`: each rank's host; `seen`: the ranks whose token rank 0 found; `listings`: the checkpoints each rank sees.
    """
    where = f"checkpoint directory {str(directory)!r}"
    unseen = [rank for rank in range(len(hosts)) if rank not in seen]
    if unseen:
        return (
            f"{where} is not shared: rank 0 on {hosts[0]} does not see the files that rank(s) {unseen} on "
            f"{', '.join(sorted({hosts[r] for r in unseen}))} wrote into it. Every rank writes its shards there and "
            f"reads others' on resume, so put it on a file system every node mounts (NFS, Lustre, GPFS, ...): "
            f"checkpoint.dir=/shared/path (HolmesCheckpoint(dirpath=...))"
        )
    differing = [rank for rank, names in enumerate(listings) if list(names) != list(listings[0])]
    if differing:
        views = "; ".join(f"rank {r} on {hosts[r]}: {', '.join(listings[r]) or 'none'}" for r in [0, *differing])
        return (
            f"ranks list different checkpoints in {where} ({views}), so they would resume from different ones; "
            f"wait until the file system shows every node the same files, then start again"
        )
    return None


def check(
    path: str | Path,
    plan: Plan | None = None,
    hyperparameters: Mapping[str, Any] | None = None,
    *,
    checksums: bool = True,
) -> Path:
    """Stop early on a checkpoint that cannot be resumed: missing, incomplete, corrupt, or from another model.

    Needs no process group: reads DCP's `.metadata`, the size of every shard file it names, `meta.pt`, `plan.json`
    and, with `checksums`, every file whole against its digest in `complete.json` (leave that to `load` where each
    of many ranks would read everything). `plan`: this run's (same number of pipeline layers); `hyperparameters`:
    values the LightningModule saved with `save_hyperparameters()` that must match (e.g. the model's shape).
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
    manifest = _read(path, COMPLETE_FILE, lambda file: json.loads(file.read_text()))
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
    if checksums:
        _refuse_damaged(path, _damaged(path, manifest.get(DIGEST, {})))
    if plan is not None:
        check_resumable(saved_plan, plan, path)
    saved = meta.get("hyper_parameters") or {}
    expected = hyperparameters or {}
    changed = [f"{k}={saved[k]!r} there, {v!r} here" for k, v in expected.items() if k in saved and saved[k] != v]
    if changed:
        raise CheckpointError(f"{where} holds another model ({'; '.join(changed)}); resume with the same settings")
    return path


def _refuse_damaged(path: Path, damaged: Sequence[str]) -> None:
    if damaged:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt: {', '.join(damaged)} changed since the save (its {DIGEST} differs "
            f"from the one in {COMPLETE_FILE}, or it is gone); {_choices(path.parent, path)}"
        )


def _read(path: Path, name: str, reader: Callable[[Path], Any]) -> Any:
    try:
        return reader(path / name)
    except Exception as err:  # truncated pickles, bad JSON, missing files: all mean this copy cannot be used
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt: {name} is unreadable ({type(err).__name__}: {err}); "
            f"{_choices(path.parent, path)}"
        ) from err


def published(directory: str | Path) -> list[str]:
    """The names of the checkpoints in `directory` that a finished save published (sorted)."""
    return sorted(p.name for p in Path(directory).glob("[!.]*") if (p / COMPLETE_FILE).is_file())


def _choices(directory: Path, exclude: Path | None = None) -> str:
    others = [name for name in published(directory) if exclude is None or name != exclude.name]
    if not others:
        return "start without resume (resume=null)"
    return f"resume from another checkpoint in {str(directory)!r} ({', '.join(others)}), or resume=auto for the newest"


def load(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    *,
    plan: Plan,
    rank: int,
    strict: bool,
    extra: Mapping[str, Any] | None = None,
    optional: Mapping[str, Callable[[], Any]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Check every file against its digest (each rank a share), then load this rank's shards into `module`,
    `optimizers` and the tensors of `extra` (in place, as `save` wrote them). Every rank calls this.

    Returns the rest of Lightning's checkpoint, with the states of `optional` (by the keys `save` wrote them under:
    what makes their templates) that the checkpoint holds, loaded under those keys; and this rank's saved random-number
    state (None when the checkpoint came from a job of another size, whose rank numbers mean other stages).
    """
    if not all((path / name).is_file() for name in (COMPLETE_FILE, PLAN_FILE, _METADATA_FILENAME)):
        raise CheckpointError(
            f"ckpt_path={str(path)!r} is not a complete HolmesStrategy checkpoint (a directory with {COMPLETE_FILE}, "
            f"{PLAN_FILE}, {_METADATA_FILENAME} and DCP shards); pass a directory that ModelCheckpoint wrote under "
            f"HolmesStrategy"
        )
    digests = json.loads((path / COMPLETE_FILE).read_text()).get(DIGEST, {})
    share = (rank, plan.world_size)
    _refuse_damaged(path, sorted(name for damaged in _gather(_damaged(path, digests, share)) for name in damaged))
    saved = Plan.from_json((path / PLAN_FILE).read_text())
    check_resumable(saved, plan, path)
    saved_keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata.keys()
    key = _model_key(saved_keys)
    lightning_state = torch.load(path / _METADATA_FILENAME, weights_only=False)
    left_out = lightning_state.pop(frozen.FINGERPRINT_KEY, {})  # frozen weights the checkpoint lacks: built already
    weights = model_state(module)
    state: dict[str, Any] = {key: {name: value for name, value in weights.items() if name not in left_out}}
    templates = [optimizer_state(module, optimizer) for optimizer in optimizers]
    stored = [_parameters_with_state(saved_keys, f"optimizer_{i}.") for i in range(len(optimizers))]
    for i, (template, held) in enumerate(zip(templates, stored, strict=True)):
        saved_here = {name for name in template if f"optimizer_{i}.{name}" in saved_keys}
        state[f"optimizer_{i}"] = {name: value for name, value in template.items() if _held(name, held, saved_here)}
    state.update(extra or {})
    found = {name: template() for name, template in (optional or {}).items() if _saved(name, saved_keys)}
    state.update(found)
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as err:  # raised on every rank alike: DCP plans the load collectively
        cause = next(iter(err.failures.values()))[0]
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit this model ({cause}); resume with the model and optimizer it "
            f"was saved from, or start without resume"
        ) from err
    set_model_state_dict(module, state[key], options=StateDictOptions(strict=strict and not left_out))
    if left_out:
        _check_frozen(path, left_out, {name: weights[name] for name in left_out.keys() & weights.keys()})
    for i, optimizer in enumerate(optimizers):
        with _without_empty_groups(optimizer):
            set_optimizer_state_dict(module, optimizer, templates[i] | state[f"optimizer_{i}"], options=OPTIONS)
        unsaved = {_owner(name) for name in templates[i] if name.startswith("state.") and _owner(name) not in stored[i]}
        _forget(module, optimizer, unsaved)
    rng = path / rng_file(rank)
    same_job = saved.world_size == plan.world_size and rng.is_file()
    lightning_state |= {name: state[name] for name in found}
    return lightning_state, torch.load(rng, weights_only=False) if same_job else None


def _check_frozen(path: Path, saved: frozen.Fingerprint, weights: Mapping[str, Any]) -> None:
    """Refuse to resume on frozen weights (this rank's: `weights`) other than those the checkpoint left out."""
    differing = frozen.differing(saved, frozen.fingerprint(weights, weights.keys(), _gather))
    if differing:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds no frozen weights: it was trained on ones this model does not have "
            f"({len(differing)} differ, e.g. {differing[0]!r}); build the model from the same pretrained weights and "
            f"dtype as the run that saved it"
        )


def _model_key(saved_keys: Collection[str]) -> str:
    """The DCP key a checkpoint of these keys keeps its weights under (`MODEL_KEY`, or an older one's)."""
    return LEGACY_MODEL_KEY if _saved(LEGACY_MODEL_KEY, saved_keys) else MODEL_KEY


def _saved(key: str, saved_keys: Collection[str]) -> bool:
    """Whether the checkpoint holds a state saved under `key`."""
    return any(name.startswith(f"{key}.") for name in saved_keys)


def _parameters_with_state(saved_keys: Collection[str], prefix: str) -> set[str]:
    """The parameters that the optimizer state saved under `prefix` holds a state for (`state.<parameter>.<name>`)."""
    return {_owner(name.removeprefix(prefix)) for name in saved_keys if name.startswith(f"{prefix}state.")}


def _held(template_key: str, stored: set[str], saved: set[str]) -> bool:
    """Whether the checkpoint holds this key of an optimizer's flattened state (`saved`: the template's keys it holds
    as such): a parameter's state where it was saved with one (not one frozen then, unfrozen since), a param group's
    setting where it was saved (not one a scheduler added since, as the LR finder's `initial_lr`, which keeps its
    value)."""
    return _owner(template_key) in stored if template_key.startswith("state.") else template_key in saved


def _owner(template_key: str) -> str:
    """The parameter of a flattened optimizer state key (`state.<parameter>.<name>`)."""
    return template_key.removeprefix("state.").rpartition(".")[0]


def _forget(module: nn.Module, optimizer: Optimizer, unsaved: set[str]) -> None:
    """Drop the state that torch's loading made up (a zero-gradient step) for the parameters `unsaved`, which the
    checkpoint holds none for: they start afresh at their first step, as after torch's `Optimizer.load_state_dict`."""
    for name, parameter in module.named_parameters() if unsaved else ():
        if name in unsaved:
            optimizer.state.pop(parameter, None)


@contextmanager
def _without_empty_groups(optimizer: Optimizer) -> Iterator[None]:
    """The optimizer without its param groups that hold none of this rank's parameters (a stage with no bias, say, on
    another plan than the one that saved), which torch's flattened load cannot take; they come back after it."""
    groups = list(optimizer.param_groups)
    optimizer.param_groups[:] = [group for group in groups if group["params"]]
    try:
        yield
    finally:
        loaded = iter(optimizer.param_groups[:])
        optimizer.param_groups[:] = [next(loaded) if group["params"] else group for group in groups]


def check_resumable(saved: Plan, plan: Plan, path: Path) -> None:
    """Shards are keyed by parameter name, so any plan over the same layers can read them."""
    if saved.num_layers != plan.num_layers:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds a model of {saved.num_layers} pipeline layers, this run has "
            f"{plan.num_layers}; resume with the same model"
        )
