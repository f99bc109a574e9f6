"""Throughput and an end-of-run summary for the GPT recipe, on top of Lightning's ThroughputMonitor."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback, ThroughputMonitor

from holmes_lightning.recipes.gpt import GPT


def throughput_monitor(model: GPT, global_batch: int, world_size: int, window: int) -> ThroughputMonitor:
    """Lightning's ThroughputMonitor for a fixed global batch, whatever the pipeline x data-parallel layout.

    Each device is credited with an equal share of the step's sequences, tokens and model FLOPs (the monitor sums
    the shares over `world_size`), so pipeline stages that see the same micro-batches are not counted twice.
    """
    share = global_batch / world_size
    model.flops_per_batch = model.flops_per_token * model.hparams.seq_len * share
    return ThroughputMonitor(
        batch_size_fn=lambda _batch: share,
        length_fn=lambda _batch: share * model.hparams.seq_len,
        window_size=window,
    )


class RunSummary(Callback):
    """Rank 0 prints the training loss (first -> last step), tokens/s and model TFLOPS when training ends."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *_args: object) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        if loss is not None:
            self.losses.append(float(loss))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or not self.losses:
            return
        metrics = trainer.logged_metrics  # the monitor's latest window (per device; x world size = whole job)
        tokens_per_s = metrics.get("train/device/items_per_sec")
        flops_per_s = metrics.get("train/device/flops_per_sec")
        world = trainer.world_size
        line = f"holmes: {len(self.losses)} steps, train loss {self.losses[0]:.3f} -> {self.losses[-1]:.3f}"
        if tokens_per_s is not None and flops_per_s is not None:
            line += (
                f" | {float(tokens_per_s) * world:,.0f} tokens/s | model {float(flops_per_s) * world / 1e12:.4f} "
                f"TFLOPS ({float(flops_per_s) / 1e12:.4f} per device x {world})"
            )
        else:
            line += " | throughput: too few logged steps for the monitor's window (raise trainer.max_steps)"
        print(line, flush=True)
