"""The LightningModule's own step hooks under pipelining, and how what they log reaches every rank.

With a pipeline the schedule runs in place of the module's training_step / validation_step / test_step. After each
step HolmesStrategy calls the module's matching hook, where it defines one, on the ranks that hold the last stage
(the only ranks with outputs):

    def pipeline_training_step(self, loss, outputs, targets, batch_idx): ...
    def pipeline_validation_step(self, loss, outputs, targets, batch_idx, dataloader_idx=0): ...
    def pipeline_test_step(self, loss, outputs, targets, batch_idx, dataloader_idx=0): ...

`loss` is the step's mean loss over all DP replicas, `outputs` and `targets` are this DP replica's (the last stage's
outputs for the whole replica batch). What the hook logs with `self.log` / `self.log_dict` is recorded there and
logged again with the same arguments on every rank of the pipeline, so Lightning sees each rank log the same names in
the same order: `sync_dist=True` averages over DP replicas, and rank 0's loggers get the values wherever rank 0 sits.

The module's `on_before_optimizer_step` runs on every rank but sees its own stage's parameters only (Lightning's
`grad_norm(self)` there gives that stage's norms); what it logs is gathered from the stages and logged on every rank,
so rank 0's loggers get the whole model's names, with `grad_norm`'s total combined over the stages.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import WarningCache
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.tensor import DTensor
from torchmetrics import Metric

from holmes_lightning.runtime.pipeline import Pipeline, StepResult

STEP_HOOKS = {
    "training_step": "pipeline_training_step",
    "validation_step": "pipeline_validation_step",
    "test_step": "pipeline_test_step",
}
DEFAULT_LOSS_NAMES = {"training_step": "train_loss", "validation_step": "val_loss", "test_step": "test_loss"}

LogCall = tuple[str, Any, tuple[Any, ...], dict[str, Any]]
NOTICES = WarningCache()  # each said once per process
GRAD_NORM_TOTAL = re.compile(r"grad_(?P<order>[0-9.]+|inf)_norm_total")  # lightning.pytorch.utilities.grad_norm's


def step_hook(module: pl.LightningModule, step: str) -> Callable[..., None] | None:
    """The module's hook for `step` ("training_step", ...), or None: the last stage keeps outputs only for a hook."""
    hook = getattr(module, STEP_HOOKS[step], None)
    return hook if callable(hook) else None


def report_step(
    module: pl.LightningModule,
    pipeline: Pipeline,
    *,
    step: str,
    result: StepResult,
    targets: torch.Tensor,
    step_args: tuple[Any, ...],
) -> None:
    """Log one pipelined step: through the module's hook for `step`, else its loss as train_loss/val_loss/test_loss."""
    hook = step_hook(module, step)
    if hook is None:
        evaluating = step != "training_step"
        module.log(DEFAULT_LOSS_NAMES[step], result.loss, prog_bar=True, sync_dist=evaluating, batch_size=len(targets))
        return
    calls: list[LogCall] = []
    if pipeline.is_last:
        with _recorded_logs(module, "a pipeline hook, which runs on the last stage only") as calls:
            hook(result.loss, result.outputs, targets, *step_args)
    if pipeline.pp_group.size() > 1:
        shared = [[(name, _portable(value), args, kwargs) for name, value, args, kwargs in calls]]
        dist.broadcast_object_list(shared, group=pipeline.pp_group, group_src=pipeline.last_stage)
        calls = calls if pipeline.is_last else shared[0]
    for name, value, args, kwargs in calls:
        module.log(name, value.to(module.device) if torch.is_tensor(value) else value, *args, **kwargs)


def say_the_steps_that_do_not_run(module: pl.LightningModule) -> None:
    """Once the pipeline is built: name the user's own steps it replaces that have no hook to log more than the loss."""
    for step in STEP_HOOKS:
        if step_hook(module, step) is None:
            _say_the_step_does_not_run(module, step)


def _say_the_step_does_not_run(module: pl.LightningModule, step: str) -> None:
    """Say once that the user's own `step` does not run, so what it logs besides the loss is not logged (a
    `ModelCheckpoint` monitoring it would only say the name was never logged)."""
    method = getattr(type(module), step, None)
    if method is None or not is_overridden(step, module) or method.__module__.startswith("holmes_lightning."):
        return
    NOTICES.info(
        f"HolmesStrategy: {type(module).__name__}.{step} does not run under pipeline stages: the schedule computes the "
        f"loss, logged as {DEFAULT_LOSS_NAMES[step]!r}; to log anything else, define "
        f"{STEP_HOOKS[step]}(self, loss, outputs, targets, batch_idx), which replaces that default"
    )


def log_every_stage(module: pl.LightningModule, pipeline: Pipeline) -> None:
    """Have what the module's own `on_before_optimizer_step` logs on each stage logged on every rank (see above)."""
    hook = "on_before_optimizer_step"
    if not is_overridden(hook, module):
        return
    own = getattr(module, hook)

    def logged_on_every_stage(optimizer: Any) -> None:
        with _recorded_logs(module, hook) as calls:
            own(optimizer)
        stages: list[Any] = [None] * pipeline.pp_group.size()
        portable = [(name, _portable(value), args, kwargs) for name, value, args, kwargs in calls]
        dist.all_gather_object(stages, portable, group=pipeline.pp_group)
        for name, value, args, kwargs in _merged(stages):
            module.log(name, value.to(module.device) if torch.is_tensor(value) else value, *args, **kwargs)

    setattr(module, hook, logged_on_every_stage)  # Lightning calls the hook by name: this instance attribute


def _merged(stages: Sequence[list[LogCall]]) -> list[LogCall]:
    """The stages' log calls as one list, in stage order: a name that several stages log once, `grad_norm`'s total
    as the norm of their totals, any other with the first stage's value."""
    merged: dict[str, LogCall] = {}
    for calls in stages:
        for name, value, args, kwargs in calls:
            if name not in merged:
                merged[name] = (name, value, args, kwargs)
            elif total := GRAD_NORM_TOTAL.fullmatch(name):
                order, before = float(total["order"]), merged[name][1]
                value = max(before, value) if math.isinf(order) else (before**order + value**order) ** (1 / order)
                merged[name] = (name, value, args, kwargs)
    return list(merged.values())


@contextmanager
def _recorded_logs(module: pl.LightningModule, where: str) -> Iterator[list[LogCall]]:
    """Record instead of log what `module.log` is given (log_dict calls it too) while the hook runs (`where`: which
    hook, for the error a torchmetrics Metric gets there)."""
    calls: list[LogCall] = []

    def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, Metric):
            raise TypeError(
                f"{type(module).__name__}: self.log({name!r}, <{type(value).__name__}>) in {where}: a torchmetrics "
                f"Metric there has no state on the other stages; log its value for this step instead, e.g. "
                f"self.log({name!r}, self.metric(outputs, targets))"
            )
        calls.append((name, value, args, kwargs))

    module.log = record  # an instance attribute shadows the method while the hook runs
    try:
        yield calls
    finally:
        del module.log


def _portable(value: Any) -> Any:
    """A logged value as it can travel to another rank: tensors detached on the CPU (a DTensor's whole value), numbers
    as they are."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().cpu() if torch.is_tensor(value) else value
