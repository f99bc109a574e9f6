"""What `train.py` checks before any process starts: the job has a feasible Plan and a usable checkpoint to resume.

The planner is pure Python, so the plan for the configured cluster, model and batch is made here from the model's
profile (`cli.models.check_model`: the analytic GPT one, an HF model's from its config): a strategy setting that
cannot fit (stages that do not divide the ranks, micro-batches that do not divide the batch, a schedule that needs
more micro-batches) fails in the launcher, not on every rank. Your own module's profile is known only once the ranks
build it; its plan is checked there.
"""

from __future__ import annotations

from dataclasses import replace

import torch

import holmes_lightning.runtime.checkpoint as checkpoint
from holmes_lightning.cli.config import ModelConfig, TrainConfig
from holmes_lightning.planner import Backend, BatchSettings, MachineCosts, ModelProfile, Plan, PlanOptions, best_plan
from holmes_lightning.topology import Topology

MODEL_SHAPE = ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size")


def check_plan(
    config: TrainConfig,
    topology: Topology,
    batch: BatchSettings,
    profile: ModelProfile,
    *,
    options: PlanOptions,
    costs: MachineCosts,
) -> Plan:
    """The plan the job's settings lead to for the model `profile` describes, costed for the collective library the
    ranks will use (the ranks plan again on the measured model; its feasibility is the same)."""
    options = replace(options, backend=collective_backend(config.trainer.accelerator))
    return best_plan(topology, profile, batch, options=options, costs=costs)


def collective_backend(accelerator: str) -> Backend:
    """What Lightning's process group will run on: NCCL on GPUs, gloo on CPU (`auto`: GPUs if there are any)."""
    if accelerator == "auto":
        return Backend.nccl if torch.cuda.is_available() else Backend.gloo
    return Backend.gloo if accelerator == "cpu" else Backend.nccl


def resume_path(config: TrainConfig, plan: Plan | None, checksums: bool = True) -> str | None:
    """`resume`: None, a checkpoint directory, or "auto" (the newest complete one in `checkpoint.dir`, if any).

    The checkpoint must be complete, readable and from this model (the layer count of `plan`, None for your own module
    until the ranks plan it; a GPT's shape); `checkpoint.check` says what is wrong otherwise (`checksums`: also every
    file's digest). Under torchrun/SLURM each rank decides this for itself: at start `HolmesCheckpoint` proves that
    every rank lists the same checkpoints, and the load takes rank 0's path.
    """
    if config.resume is None:
        return None
    path = checkpoint.latest(config.checkpoint.dir) if config.resume == "auto" else config.resume
    if path is None:
        return None
    model = config.model
    gpt = isinstance(model, ModelConfig) and model._target_ is None
    shape = {name: getattr(model, name) for name in MODEL_SHAPE} if gpt else {}
    return str(checkpoint.check(path, plan, hyperparameters=shape, checksums=checksums))
