"""`HolmesCheckpoint`: periodic checkpoints that keep the newest N, and a clean stop with a checkpoint on preemption.

SLURM, Kubernetes and our launcher send SIGTERM some time before they kill a job. The handler installed here only
notes the signal; at the next optimizer-step boundary the ranks all-reduce that note, so every rank checkpoints the
same step and stops, even when the signal reached them at different moments or reached only some of them. Lightning's
own SIGTERM handler runs a collective inside the handler (at any point of a step) and stops without saving: it is set
aside while training runs and put back afterwards.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

STOP_SIGNALS = (signal.SIGTERM,)


class HolmesCheckpoint(ModelCheckpoint):
    """Checkpoint `step_00000N.ckpt` every `every_n_steps` optimizer steps into `dirpath`, keeping the `keep` newest.

    On one of `signals` (SIGTERM by default) every rank saves at the next step boundary and training stops; the
    process then exits normally, and `resume=auto` (`checkpoint.latest`) continues from that checkpoint.
    """

    def __init__(
        self,
        dirpath: str | Path,
        every_n_steps: int | None = None,
        keep: int = 3,
        signals: Sequence[signal.Signals] = STOP_SIGNALS,
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
        self.received: signal.Signals | None = None
        self._handlers: dict[signal.Signals, Any] = {}
        self._boundary_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._boundary_step = trainer.global_step
        if threading.current_thread() is threading.main_thread():
            self._handlers = {sig: signal.signal(sig, self._note_signal) for sig in self.signals}

    def _note_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        if trainer.global_step == self._boundary_step:  # accumulating gradients: not a step boundary yet
            return
        self._boundary_step = trainer.global_step
        if not trainer.strategy.reduce_boolean_decision(self.received is not None, all=False):
            return
        if not self._should_skip_saving_checkpoint(trainer):  # skipped when this step was just saved on schedule
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
        rank_zero_info(
            f"holmes: stop requested ({self.received.name if self.received else 'on another rank'}); step "
            f"{trainer.global_step} is checkpointed in {self.dirpath}; stopping (resume=auto continues from it)"
        )
        trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._restore_handlers()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        self._restore_handlers()

    def _restore_handlers(self) -> None:
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers = {}
