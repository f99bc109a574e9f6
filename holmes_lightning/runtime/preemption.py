"""`HolmesCheckpoint`: periodic checkpoints that keep the newest N, and a clean stop with a checkpoint on preemption.

SLURM, Kubernetes and our launcher send SIGTERM some time before they kill a job. The handler installed here only
notes the signal; at the next optimizer-step boundary the ranks all-reduce that note, so every rank checkpoints the
same step and stops, even when the signal reached them at different moments or reached only some of them. Lightning's
own SIGTERM handler runs a collective inside the handler (at any point of a step) and stops without saving: it is set
aside while training runs and put back afterwards. The step in flight must finish and the checkpoint be written before
the kill: when the signal arrives, the time left (SLURM's end time, or `grace_s`) is compared with the measured step
and save times, and a warning says so when the checkpoint will not make it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

import holmes_lightning.runtime.checkpoint as checkpoint
from holmes_lightning.launch import job

STOP_SIGNALS = (signal.SIGTERM,)


class HolmesCheckpoint(ModelCheckpoint):
    """Checkpoint `step_00000N.ckpt` every `every_n_steps` optimizer steps into `dirpath`, keeping the `keep` newest.

    `dirpath` must be one directory that every node sees (checked at start). On one of `signals` (SIGTERM by
    default) every rank saves at the next step boundary and training stops; the process then exits normally, and
    `resume=auto` (`checkpoint.latest`) continues from that checkpoint. `grace_s`: seconds from the signal to the
    kill where SLURM's end time does not tell (torchrun's `--shutdown-timeout`, a Kubernetes grace period). After a
    resume, rank 0 logs when the first step ends (`holmes: step N done, the first since resuming from step M`).
    """

    def __init__(
        self,
        dirpath: str | Path,
        every_n_steps: int | None = None,
        keep: int = 3,
        signals: Sequence[signal.Signals] = STOP_SIGNALS,
        grace_s: float | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"HolmesCheckpoint(keep={keep}): keep at least 1 checkpoint, or resuming is impossible")
        super().__init__(
            dirpath=dirpath,
            filename="step_{step:06d}",  # no `=` in the name: a Hydra override needs no quotes to resume it
            auto_insert_metric_name=False,
            monitor="step",
            mode="max",
            save_top_k=keep,
            every_n_train_steps=every_n_steps or 0,
            every_n_epochs=0,  # not also after each validation, ModelCheckpoint's default without every_n_train_steps
            save_on_train_epoch_end=False,
        )
        self.signals = tuple(signals)
        self.grace_s = grace_s
        self.received: signal.Signals | None = None
        self.step_s: float | None = None  # the plan's predicted step, then the last measured one
        self.save_s: float | None = None  # the last save's duration
        self.saving_s = 0.0  # every save's, in total
        self._handlers: dict[signal.Signals, Any] = {}
        self._boundary_step = -1
        self._boundary_time = 0.0
        self._resumed_from: int | None = None  # the step a resumed fit restored, until its first step ends

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # agrees on rank 0's dirpath
        if stage == TrainerFn.FITTING and self.dirpath is not None:
            checkpoint.check_shared(Path(self.dirpath))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._boundary_step, self._boundary_time = trainer.global_step, time.monotonic()
        self._resumed_from = trainer.global_step if trainer.ckpt_path else None
        plan = getattr(trainer.strategy, "plan", None)
        self.step_s = plan.prediction.total_s if plan is not None else None
        if threading.current_thread() is threading.main_thread():
            self._handlers = {sig: signal.signal(sig, self._note_signal) for sig in self.signals}

    def _note_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)
        seconds_left = job.seconds_until_kill(os.environ, time.time(), self.grace_s)
        outlook = job.stop_outlook(seconds_left, self.step_s, self.save_s)
        if outlook is not None:
            rank_zero_warn(f"holmes: {self.received.name}: {outlook}")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        if trainer.global_step == self._boundary_step:  # accumulating gradients: not a step boundary yet
            return
        now = time.monotonic()
        self.step_s, self._boundary_step, self._boundary_time = now - self._boundary_time, trainer.global_step, now
        if self._resumed_from is not None:  # one line that training goes on (bench=elastic times the resume by it)
            step, resumed = trainer.global_step, self._resumed_from
            rank_zero_info(f"holmes: step {step} done, the first since resuming from step {resumed}")
            self._resumed_from = None
        if not _any_rank(self.received is not None, trainer.strategy.root_device):
            return
        if not self._should_skip_saving_checkpoint(trainer):  # skipped when this step was just saved on schedule
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
        rank_zero_info(
            f"holmes: stop requested ({self.received.name if self.received else 'on another rank'}); step "
            f"{trainer.global_step} is checkpointed in {self.dirpath}; stopping (resume=auto continues from it)"
        )
        trainer.should_stop = True

    @override
    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        started = time.monotonic()
        super()._save_checkpoint(trainer, filepath)
        self.save_s = time.monotonic() - started
        self.saving_s += self.save_s
        self._boundary_time += self.save_s  # the next step's time is the step's own

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._restore_handlers()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        self._restore_handlers()

    def _restore_handlers(self) -> None:
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers = {}


def _any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on any: one all-reduce (Lightning's `reduce_boolean_decision` runs a
    barrier before it, a second collective every step)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    vote = torch.tensor([float(flag)], device=device)
    dist.all_reduce(vote, op=dist.ReduceOp.MAX)
    return bool(vote.item())
