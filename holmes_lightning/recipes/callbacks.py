"""Throughput and an end-of-run summary for train.py's jobs, on top of Lightning's ThroughputMonitor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage

from holmes_lightning.measure import peak_resident_bytes, resident_bytes
from holmes_lightning.runtime.contract import split_batch


def throughput_monitor(
    model: L.LightningModule,
    global_batch: int,
    world_size: int,
    window: int,
    paused_s: Callable[[], float] = lambda: 0.0,
    *,
    flops_per_sample: float | None = None,
) -> ThroughputMonitor:
    """Lightning's ThroughputMonitor for a fixed global batch, whatever the pipeline x data-parallel layout.

    Each device is credited with an equal share of the step's sequences, tokens (a sequence's: its first input's
    elements, as the profile counts them) and model FLOPs (`flops_per_sample`: training FLOPs of one sequence; None
    leaves `model.flops_per_batch` as the model has it), the monitor summing the shares over `world_size`, so pipeline
    stages that see the same micro-batches are not counted twice. `paused_s`: seconds spent so far outside training
    steps that the monitor must leave out, as it leaves out validation (`HolmesCheckpoint.saving_s`: checkpoint saves).
    """
    share = global_batch / world_size
    if flops_per_sample is not None:
        model.flops_per_batch = flops_per_sample * share
    return PausableThroughputMonitor(
        paused_s,
        batch_size_fn=lambda _batch: share,
        length_fn=lambda batch: share * split_batch(batch)[0][0][0].numel(),
        window_size=window,
    )


class PausableThroughputMonitor(ThroughputMonitor):
    """ThroughputMonitor whose training clock also stops for the seconds `paused_s()` adds (a checkpoint save)."""

    def __init__(self, paused_s: Callable[[], float], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.paused_s = paused_s
        self._paused_seen = 0.0

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self._paused_seen = self.paused_s()

    def on_validation_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_validation_start(trainer, *args)
        # Lightning's own shift at validation's end covers everything since the last training step, a save included
        self._paused_seen = self.paused_s()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        paused = self.paused_s()
        if trainer.is_global_zero:  # the monitor keeps its clocks on rank 0 only
            self._t0s[RunningStage.TRAINING] += paused - self._paused_seen  # as Lightning's on_validation_end does
        self._paused_seen = paused
        super().on_train_batch_end(trainer, *args)


class RunSummary(Callback):
    """Rank 0 prints the training loss (first -> last step), tokens/s next to the plan's prediction, model TFLOPS and
    MFU (where the model's FLOPs are known), and the ranks' peak memory next to the plan's estimate when training ends.

    Throughput leaves out validation and checkpoint saves (`throughput_monitor`); their seconds follow it.
    MFU is against the calibrated peak: what one rank of this machine computes on this model's layers at full batch
    (`HolmesStrategy.calibration`, measured at job start), not a datasheet number; without a calibration there is none
    (`calibrate=False`, or a resume that runs its checkpoint's plan again and so calibrates nothing).
    Peak memory is what the planner estimates, training's above the process's own: on a GPU the allocator's peak, on
    CPU the peak resident memory above the rank's at `setup` (before the model is materialised).
    """

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.baseline_bytes = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        else:
            self.baseline_bytes = resident_bytes()

    def peak_gb(self, trainer: L.Trainer) -> list[float]:
        """Every rank's peak training memory in GB (a collective: every rank calls it)."""
        device = trainer.strategy.root_device
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = max(peak_resident_bytes() - self.baseline_bytes, 0)
        if not dist.is_available() or not dist.is_initialized():
            return [peak / 1e9]
        peaks: list[int] = [0] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
        return [value / 1e9 for value in peaks]

    def on_train_batch_end(self, trainer: L.Trainer, *_args: object) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        if loss is not None:
            self.losses.append(float(loss))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        peaks = self.peak_gb(trainer)
        if not trainer.is_global_zero or not self.losses:
            return
        metrics = trainer.logged_metrics  # the monitor's latest window (per device; x world size = whole job)
        tokens_per_s = metrics.get("train/device/items_per_sec")
        flops_per_s = metrics.get("train/device/flops_per_sec")
        world = trainer.world_size
        line = f"holmes: {len(self.losses)} steps, train loss {self.losses[0]:.3f} -> {self.losses[-1]:.3f}"
        plan = getattr(trainer.strategy, "plan", None)
        memory = f" | peak memory per rank {min(peaks):.3g}-{max(peaks):.3g} GB"
        if plan is not None:
            memory += f" (planned up to {plan.prediction.memory_gb:.3g})"
        if tokens_per_s is None:
            print(
                f"{line} | throughput: too few logged steps for the monitor's window (raise trainer.max_steps){memory}"
            )
            return
        measured = float(tokens_per_s) * world
        line += f" | {measured:,.0f} tokens/s"
        if plan is not None and plan.prediction.tokens_per_s > 0:
            predicted = plan.prediction.tokens_per_s
            line += f" (predicted {predicted:,.0f}: measured / predicted {measured / predicted:.2f})"
        line += " without validation and checkpoint saves"
        if flops_per_s is not None:
            per_device = float(flops_per_s)
            line += f" | model {per_device * world / 1e12:.4f} TFLOPS ({per_device / 1e12:.4f} per device x {world})"
            calibrated = getattr(trainer.strategy, "calibration", None)
            if calibrated is not None:
                line += (
                    f" | MFU {per_device / (calibrated.device_tflops * 1e12):.0%} of the calibrated peak "
                    f"({calibrated.device_tflops:.3g} TFLOPS per rank, measured at start)"
                )
        line += memory
        saving_s = sum(getattr(callback, "saving_s", 0.0) for callback in trainer.checkpoint_callbacks)
        if saving_s:
            line += f" | checkpoint saves {saving_s:.1f} s in all"
        print(line, flush=True)
