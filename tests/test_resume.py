"""Exact resume, preemption and crash-safe checkpoints on pp=2 x dp=2 (4 gloo processes, two_cluster_mixed).

Two launches: the first SIGKILLs rank 1 in the middle of saving step 6; the second trains without interruption,
is preempted by SIGTERM on two of its ranks, resumes from the preemption checkpoint (mid-epoch) and from the crashed
run's last good checkpoint, and every resumed step's loss must equal the uninterrupted run's. The model has dropout,
so each rank's random numbers must be restored as well as the weights, optimizer, LR schedule and data position.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
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
PREEMPT_AT, PREEMPTED_RANKS = 4, (0, 3)  # step 4 is mid-epoch; ranks 1 and 2 never see a signal
CRASH_RANK, CRASH_STEP = 1, 6


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


def fit(directory: Path, ckpt_path: Path | None = None, callbacks: tuple[L.Callback, ...] = ()) -> list[float]:
    """Train DropoutMLP on pp=2 x dp=2 until MAX_STEPS (or a stop), checkpointing into `directory`; step losses.

    The plan is pinned: each launch calibrates anew, and two near-equal splits can swap places with the machine's
    noise; a resumed run on another split restores each rank's random state for other dropout layers.
    """
    L.seed_everything(SEED)
    recorder = LossRecorder()
    strategy = HolmesStrategy(
        cluster="two_cluster_mixed",
        pp=2,
        dp=2,
        partition=[1, 5],
        global_batch=GLOBAL_BATCH,
        microbatches=4,
        timeout=60,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=4,
        strategy=strategy,
        max_steps=MAX_STEPS,
        gradient_clip_val=0.3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, *callbacks, HolmesCheckpoint(directory, every_n_steps=EVERY, keep=KEEP)],
    )
    loader = tiny_loader(STEPS_PER_EPOCH * GLOBAL_BATCH, GLOBAL_BATCH // 2)
    trainer.fit(DropoutMLP(), loader, ckpt_path=ckpt_path)
    return recorder.losses


def crash_while_saving(directory: str) -> None:
    """Rank side of launch 1: rank 1 is SIGKILLed while step 6 is being saved; the job must not publish it."""
    fit(Path(directory), callbacks=(KillWhileSaving(CRASH_RANK, f"step_{CRASH_STEP:06d}.ckpt"),))


def resume_cases(root: str, crashed: str) -> dict[str, Any]:
    """Rank side of launch 2: uninterrupted, preempted, resumed after preemption, resumed after the crash."""
    root_path, crashed_path = Path(root), Path(crashed)
    uninterrupted = fit(root_path / "full")
    preempted = fit(root_path / "preempted", callbacks=(SignalAt(PREEMPT_AT, PREEMPTED_RANKS),))
    after_preemption = checkpoint.latest(root_path / "preempted")
    resumed = fit(root_path / "preempted", ckpt_path=after_preemption)
    after_crash = checkpoint.latest(crashed_path)
    return {
        "uninterrupted": uninterrupted,
        "kept": sorted(p.name for p in (root_path / "full").iterdir()),
        "preempted": preempted,
        "preemption_checkpoint": after_preemption.name,
        "resumed": resumed,
        "crash_checkpoint": after_crash.name,
        "resumed_after_crash": fit(crashed_path, ckpt_path=after_crash),
    }


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    directory = tmp_path_factory.mktemp("crashed")
    with pytest.raises(RuntimeError, match="exit code 137") as failure:
        run_ranks("test_resume:crash_while_saving", directory=str(directory))
    return directory, str(failure.value)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, crashed: tuple[Path, str]) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("resume")
    return run_ranks("test_resume:resume_cases", root=str(root), crashed=str(crashed[0]))


@pytest.mark.slow
def test_a_crash_while_saving_leaves_the_last_good_checkpoint(crashed: tuple[Path, str]) -> None:
    directory, _ = crashed
    published = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
    assert published == ["step_000003.ckpt"]  # step 6 never appeared under its name
    assert (directory / f".step_{CRASH_STEP:06d}.ckpt.partial").is_dir()  # the interrupted save, left aside
    assert checkpoint.latest(directory) == directory / "step_000003.ckpt"
    checkpoint.check(directory / "step_000003.ckpt")  # complete and readable


@pytest.mark.slow
def test_resume_after_the_crash_continues_the_uninterrupted_run(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert result["crash_checkpoint"] == "step_000003.ckpt"
        assert result["resumed_after_crash"] == pytest.approx(result["uninterrupted"][3:], rel=1e-6)


@pytest.mark.slow
def test_sigterm_on_some_ranks_checkpoints_the_same_step_everywhere(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert len(result["preempted"]) == PREEMPT_AT  # every rank stopped after the same step
        assert result["preemption_checkpoint"] == f"step_{PREEMPT_AT:06d}.ckpt"


@pytest.mark.slow
def test_mid_epoch_resume_gives_the_uninterrupted_losses(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert result["preempted"] == pytest.approx(result["uninterrupted"][:PREEMPT_AT], rel=1e-6)
        assert result["resumed"] == pytest.approx(result["uninterrupted"][PREEMPT_AT:], rel=1e-6)


@pytest.mark.slow
def test_only_the_newest_checkpoints_are_kept(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["kept"] == ["step_000006.ckpt", "step_000009.ckpt"]  # step 3 removed once two newer ones existed
