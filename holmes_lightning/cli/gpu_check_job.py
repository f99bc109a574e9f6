"""The rank side of `python -m holmes_lightning.cli.gpu_check`: one job per run (`TrainRun`, `CalibrationRun`),
started by `torchrun --standalone`, rank 0 writing what it saw as JSON."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from holmes_lightning.cli.config import ModelConfig
from holmes_lightning.cli.gpu_check import (
    CALIBRATED,
    CALIBRATION_SECONDS,
    CLIP_NORM,
    SCHEDULE,
    SEED,
    WORKLOADS,
    CalibrationRun,
    TrainRun,
    Workload,
)
from holmes_lightning.cli.models import gpt
from holmes_lightning.launch.shutdown import skip_exit_collections
from holmes_lightning.measure import (
    calibration,
    peak_resident_bytes,
    profile_modules,
    resident_bytes,
    restart_peak_resident,
)
from holmes_lightning.measure.layer_io import as_tuple
from holmes_lightning.recipes import GPT
from holmes_lightning.runtime import HolmesStrategy

GB = 1e9


class Probes(L.Callback):
    """What a check reads of a run: each step's loss and seconds, the gradients' norm before and after clipping, the
    dtype the first linear layer's weight has in forward, and the peak memory of training."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline_bytes = 0
        self.losses: list[float] = []
        self.step_s: list[float] = []
        self.norms_before: list[float] = []
        self.norms_after: list[float] = []
        self.forward_dtypes: set[str] = set()
        self.structure: dict[str, Any] = {}
        self.peak_bytes = 0
        self._started = 0.0

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.restart_peak_memory(module)
        linear = next(m for m in module.modules() if isinstance(m, nn.Linear))
        linear.register_forward_pre_hook(lambda layer, _args: self.forward_dtypes.add(str(layer.weight.dtype)))
        optimizer = trainer.optimizers[0]
        optimizer.register_step_post_hook(lambda opt, _args, _kwargs: self.norms_after.append(gradient_norm(opt)))
        self.structure = structure(trainer.strategy, module)

    def restart_peak_memory(self, module: L.LightningModule) -> None:
        """From here the peak counts: on a GPU the allocator's; on CPU the process's resident memory, above what it
        held besides the module's parameters and buffers (interpreter, libraries, process groups)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        restart_peak_resident()  # where it cannot (Linux before 4.0), the peak counts from the process's start
        held = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
        self.baseline_bytes = resident_bytes() - held

    def on_train_batch_start(self, *_args: Any) -> None:
        synchronize(self.device)
        self._started = time.perf_counter()

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        self.norms_before.append(gradient_norm(optimizer))

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *_args: Any) -> None:
        synchronize(self.device)
        self.step_s.append(time.perf_counter() - self._started)
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak_bytes = peak_resident_bytes() - self.baseline_bytes


def gradient_norm(optimizer: torch.optim.Optimizer) -> float:
    """The 2-norm of this rank's gradients (whole tensors: FSDP2's shards gathered)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def structure(strategy: HolmesStrategy, module: L.LightningModule) -> dict[str, Any]:
    """What ran: the plan's layout, the pipeline's schedule and stages here, FSDP2's modules and parameters."""
    plan, pipeline = strategy.plan, strategy.pipeline
    assert plan is not None
    return {
        "pp": plan.pp,
        "dp": plan.dp,
        "sharding": str(plan.sharding),
        "virtual_stages": plan.num_virtual_stages,
        "microbatches": plan.microbatches,
        "checkpointing": str(plan.stages[0].checkpointing),
        "memory_gb": plan.stages[0].memory_gb,
        "schedule": get_schedule_class(plan.schedule.value).__name__ if pipeline else None,
        "local_stages": len(pipeline.chunks) if pipeline else 0,  # a PipelineStage each
        "fsdp_modules": sum(isinstance(m, FSDPModule) for m in module.modules()),
        "dtensor_params": all(isinstance(p, DTensor) for p in module.parameters()),
        "backend": strategy.process_group_backend,
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def counting_sequences(count: int, model: ModelConfig, seed: int) -> TensorDataset:
    """`count` (inputs, targets) pairs of counting sequences mod the vocabulary: learnable, the same in every run."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, model.vocab_size, (count, 1), generator=generator)
    tokens = (starts + torch.arange(model.seq_len + 1)) % model.vocab_size
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def one_node(processes: int) -> dict[str, Any]:
    """The cluster config of this machine: one node of `processes` devices."""
    return {
        "name": "gpu_check",
        "devices_per_node": processes,
        "clusters": [{"name": "local", "nodes": 1, "nic": {"kind": None}}],
    }


def build_gpt(work: Workload) -> GPT:
    """The check's GPT on the meta device (each rank allocates only its part), as train.py builds it."""
    with torch.device("meta"):
        return gpt(work.model, learning_rate=1e-3, warmup_steps=1)


def job_device(kind: str) -> torch.device:
    """This rank's device: its local GPU, or the CPU."""
    return torch.device("cuda", int(os.environ["LOCAL_RANK"])) if kind == "cuda" else torch.device("cpu")


def holmes_strategy(run: TrainRun, work: Workload, processes: int) -> HolmesStrategy:
    """The run's layout on Interleaved1F1B, FSDP2 and its mixed-precision policy forced even on one rank."""
    return HolmesStrategy(
        cluster=one_node(processes),
        pp=run.pp,
        dp=run.dp,
        schedule=SCHEDULE,
        sharding="fsdp",
        activation_checkpointing=run.checkpointing,
        global_batch=work.global_batch,
        microbatches=run.microbatches or work.microbatches,
        fsdp_on_one_rank=True,
    )


def trainer_for(run: TrainRun, work: Workload, strategy: HolmesStrategy, probes: Probes) -> L.Trainer:
    """bf16-mixed steps with clipping, validation at the epoch's end, and a checkpoint where the run writes one."""
    callbacks: list[L.Callback] = [probes]
    if run.save_dir:
        every = work.checkpoint_step
        callbacks.append(ModelCheckpoint(dirpath=run.save_dir, filename="{step}", every_n_train_steps=every))
    return L.Trainer(
        accelerator="gpu" if run.device == "cuda" else "cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        precision=work.precision,
        max_steps=work.steps,
        gradient_clip_val=CLIP_NORM,
        limit_val_batches=work.val_batches,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=run.save_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def loaders(work: Workload, dp: int) -> tuple[DataLoader, DataLoader]:
    """Train and validation data, each DP replica's share of the global batch per step (one epoch: `steps`)."""
    train_data = counting_sequences(work.steps * work.global_batch, work.model, SEED)
    val_data = counting_sequences(work.val_batches * work.global_batch, work.model, SEED + 1)
    replica_batch = work.global_batch // dp
    return (
        DataLoader(train_data, batch_size=replica_batch, drop_last=True),
        DataLoader(val_data, batch_size=replica_batch, drop_last=True),
    )


def train(run: TrainRun) -> dict[str, Any] | None:
    """Fit the workload's GPT under HolmesStrategy as `run` says; rank 0's observations (None on other ranks)."""
    work = WORKLOADS[run.device]
    L.seed_everything(SEED)
    probes = Probes(job_device(run.device))
    model = build_gpt(work)
    trainer = trainer_for(run, work, holmes_strategy(run, work, int(os.environ["WORLD_SIZE"])), probes)
    trainer.fit(model, *loaders(work, run.dp), ckpt_path=run.resume_from)
    if trainer.global_rank != 0:
        return None
    return {
        **probes.structure,
        "losses": probes.losses,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "step_s": probes.step_s,
        "norms_before": probes.norms_before,
        "norms_after": probes.norms_after,
        "forward_dtypes": sorted(probes.forward_dtypes),
        "peak_gb": probes.peak_bytes / GB,
        "checkpoints": sorted(p.name for p in Path(run.save_dir).iterdir()) if run.save_dir else [],
    }


def calibrate(run: CalibrationRun) -> dict[str, Any]:
    """TFLOPS of the workload's layers in each precision of `CALIBRATED`, by calibration's own timing (fresh, not
    cached; the cache it writes is what the training runs then read for bf16-mixed)."""
    work = WORKLOADS[run.device]
    device = job_device(run.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_gpt(work)
    layers, sample = model.pipeline_layers(), as_tuple(model.example_input_array)
    flops = profile_modules(layers, sample).flops_per_sample
    results = {}
    for name, precision in CALIBRATED.items():
        measured = calibration.measure(
            layers, sample, device=device, seconds=CALIBRATION_SECONDS, fresh=True, precision=precision
        )
        results[name] = {"tflops": flops / measured.per_sample_s / 1e12, "fsdp_pass_ms": measured.fsdp_pass_s * 1e3}
    return {"device": calibration.device_name(device), "precisions": results}


def run_job(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The job `spec` names (`kind`: train or calibrate, and its run's fields)."""
    kind, fields = spec["kind"], {k: v for k, v in spec.items() if k != "kind"}
    if kind == "calibrate":
        return calibrate(CalibrationRun(**fields))
    return train(TrainRun(**fields))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m holmes_lightning.cli.gpu_check_job SPEC REPORT` on every rank; rank 0 writes REPORT."""
    spec, report = argv if argv is not None else sys.argv[1:]
    skip_exit_collections()
    result = run_job(json.loads(spec))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(report).write_text(json.dumps(result))
    if dist.is_initialized():  # every group ends here, not in the interpreter's teardown (where gloo's can abort)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
