"""Exact resume, preemption and crash-safe checkpoints on pp=2 x dp=2 (4 gloo processes, two_cluster_mixed), and
resumes that run their checkpoint's plan again.

The model has dropout, so each rank's random numbers must be restored as well as the weights, optimizer, LR schedule
and data position, and on the same split: a resume on another one gives ranks other layers' random states. Each
launch plans afresh, so every comparison stays within one plan's lineage: a resume on the same nodes runs the plan
stored with the checkpoint it loads, as it does by default.

Two launches on pp=2 x dp=2 (the planner picks the partition): the first SIGKILLs rank 1 in the middle of saving step
6, each rank writing its losses as it goes; the second trains without interruption, resumes from its step-6
checkpoint and is preempted by SIGTERM on two of its ranks at step 7 (mid-epoch), resumes from the preemption
checkpoint, and resumes from the crashed run's last good checkpoint: every resumed step's loss must equal the run's it
continues. Two more launches pin nothing (the planner picks pp, dp, partition and micro-batches; the DataLoader's
batch size fixes the batch): the first trains and saves, the second resumes from its step-6 checkpoint without
calibrating and gets the same losses; with `replan=True` or another schedule it plans afresh.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from distributed import LossRecorder, TinyMLP, run_ranks, tiny_loader
from torch import nn

from holmes_lightning import HolmesStrategy
from holmes_lightning.runtime import checkpoint
from holmes_lightning.runtime.preemption import HolmesCheckpoint

SEED, GLOBAL_BATCH, STEPS_PER_EPOCH, MAX_STEPS = 5, 16, 5, 9
EVERY, KEEP = 3, 2
RESUME_AT, PREEMPT_AT, PREEMPTED_RANKS = 6, 7, (0, 3)  # step 7 is mid-epoch; ranks 1 and 2 never see a signal
CRASH_RANK, CRASH_STEP = 1, 6
PINNED = {"pp": 2, "dp": 2, "global_batch": GLOBAL_BATCH, "microbatches": 4}
REPLICA_BATCH = 4  # unpinned: each DP replica's batch, as the DataLoader gives it


class DropoutMLP(TinyMLP):
    """TinyMLP with dropout after every hidden layer: each step draws random numbers on every rank."""

    def __init__(self) -> None:
        super().__init__(lr=0.02, step_size=3)
        for layer in self.layers[:-1]:
            layer.append(nn.Dropout(0.2))


class SignalAt(L.Callback):
    """Sends `signum` to this process after step `step`, as a scheduler would (the signal arrives mid-run)."""

    def __init__(self, step: int, ranks: tuple[int, ...], signum: int = signal.SIGTERM) -> None:
        self.step, self.ranks, self.signum = step, ranks, signum

    def on_train_batch_end(self, trainer: L.Trainer, *_args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank in self.ranks:
            os.kill(os.getpid(), self.signum)


class LossFile(LossRecorder):
    """Also writes the losses so far to `directory/rank<N>.json` after every step: a run killed later leaves them."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.losses))


class LoggedLines(logging.Handler):
    """Every line of the messages Lightning's logger gets while attached (`rank_zero_info`: on rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(record.getMessage().splitlines())


@contextmanager
def logged_lines() -> Iterator[list[str]]:
    handler, logger = LoggedLines(), logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


class KillWhileSaving(L.Callback):
    """SIGKILLs this rank once it has begun writing `name` (its own file in the staging directory exists)."""

    def __init__(self, rank: int, name: str) -> None:
        self.rank, self.name = rank, name

    def on_train_start(self, trainer: L.Trainer, _module: L.LightningModule) -> None:
        if trainer.global_rank != self.rank:
            return
        callback = trainer.checkpoint_callback
        mine = Path(callback.dirpath, f".{self.name}.partial", checkpoint.rng_file(self.rank))
        sys.setswitchinterval(1e-4)  # the watcher must get the GIL while the main thread writes the checkpoint

        def watch() -> None:
            while not mine.exists():
                time.sleep(1e-4)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, daemon=True).start()


@dataclass
class Run:
    """One `fit`: the loss of every step, the plan (JSON), whether it calibrated, and rank 0's log."""

    losses: list[float]
    plan: str
    calibrated: bool
    log: list[str]


def fit(
    directory: Path,
    ckpt_path: Path | None = None,
    callbacks: tuple[L.Callback, ...] = (),
    *,
    settings: Mapping[str, Any] = PINNED,
    batch_size: int = GLOBAL_BATCH // 2,
    max_steps: int = MAX_STEPS,
) -> Run:
    """Train DropoutMLP under HolmesStrategy(`settings`) until `max_steps` (or a stop), checkpointing into
    `directory`, each DP replica reading batches of `batch_size`."""
    L.seed_everything(SEED)
    recorder = LossRecorder()
    strategy = HolmesStrategy(cluster="two_cluster_mixed", timeout=60, **settings)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=4,
        strategy=strategy,
        max_steps=max_steps,
        gradient_clip_val=0.3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, *callbacks, HolmesCheckpoint(directory, every_n_steps=EVERY, keep=KEEP)],
    )
    loader = tiny_loader(STEPS_PER_EPOCH * GLOBAL_BATCH, batch_size)
    with logged_lines() as log:
        trainer.fit(DropoutMLP(), loader, ckpt_path=ckpt_path)
    return Run(recorder.losses, strategy.plan.to_json(), strategy.calibration is not None, log)


def crash_while_saving(directory: str, losses: str) -> None:
    """Rank side of launch 1: rank 1 is SIGKILLed while step 6 is being saved; the job must not publish it."""
    fit(Path(directory), callbacks=(KillWhileSaving(CRASH_RANK, f"step_{CRASH_STEP:06d}.ckpt"), LossFile(Path(losses))))


def resume_cases(root: str, crashed: str) -> dict[str, Any]:
    """Rank side of launch 2: uninterrupted, resumed then preempted, resumed after preemption, resumed after the
    crash."""
    root_path, crashed_path = Path(root), Path(crashed)
    uninterrupted = fit(root_path / "full")
    kept = sorted(p.name for p in (root_path / "full").iterdir())
    signal_at = SignalAt(PREEMPT_AT, PREEMPTED_RANKS)
    preempted = fit(root_path / "preempted", root_path / "full" / f"step_{RESUME_AT:06d}.ckpt", (signal_at,))
    after_preemption = checkpoint.latest(root_path / "preempted")
    resumed = fit(root_path / "preempted", ckpt_path=after_preemption)
    after_crash = checkpoint.latest(crashed_path)
    return {
        "uninterrupted": uninterrupted.losses,
        "kept": kept,
        "preempted": preempted.losses,
        "preemption_checkpoint": after_preemption.name,
        "resumed": resumed.losses,
        "plans": [run.plan for run in (uninterrupted, preempted, resumed)],
        "crash_checkpoint": after_crash.name,
        "resumed_after_crash": fit(crashed_path, ckpt_path=after_crash).losses,
    }


def train_unpinned(directory: str) -> dict[str, Any]:
    """Rank side of launch 3: a run with nothing pinned, checkpointing every EVERY steps."""
    run = fit(Path(directory), settings={}, batch_size=REPLICA_BATCH)
    return {"losses": run.losses, "plan": run.plan}


def resume_unpinned(directory: str, restarted: str) -> dict[str, Any]:
    """Rank side of launch 4: resume launch 3's run from step RESUME_AT as it was, with replan=True (one step), and
    with another schedule (one step)."""
    step = Path(directory, f"step_{RESUME_AT:06d}.ckpt")

    def resume(name: str, max_steps: int = MAX_STEPS, **settings: Any) -> Run:
        return fit(Path(restarted, name), step, settings=settings, batch_size=REPLICA_BATCH, max_steps=max_steps)

    runs = {
        "again": resume("again"),
        "replanned": resume("replanned", RESUME_AT + 1, replan=True),
        "changed": resume("changed", RESUME_AT + 1, schedule="GPipe"),
    }
    return {name: vars(run) for name, run in runs.items()}


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[float]]]:
    """The crashed run's checkpoint directory, and each rank's losses until it was killed."""
    directory, losses = tmp_path_factory.mktemp("crashed"), tmp_path_factory.mktemp("crashed_losses")
    with pytest.raises(RuntimeError, match="exit code 137"):
        run_ranks("test_resume:crash_while_saving", directory=str(directory), losses=str(losses))
    return directory, [json.loads(Path(losses, f"rank{rank}.json").read_text()) for rank in range(4)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, crashed: tuple[Path, list[list[float]]]) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("resume")
    return run_ranks("test_resume:resume_cases", root=str(root), crashed=str(crashed[0]))


@pytest.mark.slow
def test_a_crash_while_saving_leaves_the_last_good_checkpoint(crashed: tuple[Path, list[list[float]]]) -> None:
    directory, _ = crashed
    published = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
    assert published == ["step_000003.ckpt"]  # step 6 never appeared under its name
    assert (directory / f".step_{CRASH_STEP:06d}.ckpt.partial").is_dir()  # the interrupted save, left aside
    assert checkpoint.latest(directory) == directory / "step_000003.ckpt"
    checkpoint.check(directory / "step_000003.ckpt")  # complete and readable


@pytest.mark.slow
def test_resume_after_the_crash_continues_the_run_that_crashed(
    ranks: list[dict[str, Any]], crashed: tuple[Path, list[list[float]]]
) -> None:
    """Another launch, on the plan stored with the crashed run's checkpoint: its steps 4-6 as the crashed run had
    them before it was killed."""
    for result, before_the_crash in zip(ranks, crashed[1], strict=True):
        assert result["crash_checkpoint"] == "step_000003.ckpt"
        assert len(before_the_crash) == CRASH_STEP
        assert result["resumed_after_crash"][: CRASH_STEP - 3] == pytest.approx(before_the_crash[3:], rel=1e-6)


@pytest.mark.slow
def test_sigterm_on_some_ranks_checkpoints_the_same_step_everywhere(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert len(result["preempted"]) == PREEMPT_AT - RESUME_AT  # every rank stopped after the same step
        assert result["preemption_checkpoint"] == f"step_{PREEMPT_AT:06d}.ckpt"


@pytest.mark.slow
def test_mid_epoch_resume_gives_the_uninterrupted_losses(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert len(set(result["plans"])) == 1  # each resume ran the plan of the run it continues
        assert result["preempted"] == pytest.approx(result["uninterrupted"][RESUME_AT:PREEMPT_AT], rel=1e-6)
        assert result["resumed"] == pytest.approx(result["uninterrupted"][PREEMPT_AT:], rel=1e-6)


@pytest.mark.slow
def test_only_the_newest_checkpoints_are_kept(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["kept"] == ["step_000006.ckpt", "step_000009.ckpt"]  # step 3 removed once two newer ones existed


@pytest.fixture(scope="module")
def unpinned(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each rank's results of launch 3 (train and save) and of launch 4 (resume in fresh processes)."""
    directory = str(tmp_path_factory.mktemp("unpinned"))
    first = run_ranks("test_resume:train_unpinned", directory=directory)
    restarted = str(tmp_path_factory.mktemp("restarted"))
    return first, run_ranks("test_resume:resume_unpinned", directory=directory, restarted=restarted)


@pytest.mark.slow
def test_a_resume_on_the_same_nodes_runs_the_stored_plan_and_reproduces_the_losses(
    unpinned: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    first, second = unpinned
    for before, after in zip(first, second, strict=True):
        again = after["again"]
        assert again["plan"] == before["plan"]
        assert not again["calibrated"]  # calibration decides only the plan: nothing to measure
        assert again["losses"] == pytest.approx(before["losses"][RESUME_AT:], rel=1e-6)
    said = [line for line in second[0]["again"]["log"] if "plan stored with checkpoint" in line]
    assert len(said) == 1 and f"step_{RESUME_AT:06d}.ckpt again" in said[0] and "strategy.replan=true" in said[0]


@pytest.mark.slow
def test_replan_or_a_changed_request_plans_afresh(
    unpinned: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    _, second = unpinned
    assert all(result[name]["calibrated"] for result in second for name in ("replanned", "changed"))
    assert all(json.loads(result["changed"]["plan"])["schedule"] == "GPipe" for result in second)
    why = {
        name: [line for line in second[0][name]["log"] if line.startswith("holmes: a new plan, not the plan stored")]
        for name in ("replanned", "changed")
    }
    assert len(why["replanned"]) == 1 and why["replanned"][0].endswith(": replan=True")
    assert len(why["changed"]) == 1 and why["changed"][0].endswith(": schedule='1F1B' there, 'GPipe' here")
