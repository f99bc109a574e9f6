"""The LightningModule's own metrics, evaluation and prediction under pipelining (pp=2 x dp=2, 4 gloo processes).

A model that logs its own metric names (loss and accuracy) from its steps in one process, and from its pipeline hooks
under HolmesStrategy, and its gradient norms from `on_before_optimizer_step` (each stage's there), must log the same
values; `trainer.validate`, `test` and `predict` after `fit`, and on a fresh Trainer and model, must match one
process. One launch runs all of it. Also here, in this process: what the last stage keeps, and the errors for
settings a pipeline cannot run.
"""

from __future__ import annotations

import logging
import os
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
import torch.distributed as dist
from distributed import TinyMLP, run_ranks, tiny_dataset, tiny_loader
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from holmes_lightning import HolmesStrategy
from holmes_lightning.planner import Plan, StagePlan, StepPrediction
from holmes_lightning.recipes.gpt import GPT
from holmes_lightning.runtime.hooks import _say_the_step_does_not_run, step_hook
from holmes_lightning.runtime.pipeline import Pipeline
from holmes_lightning.topology import LinkKind, NICKind

SEED, STEPS, GLOBAL_BATCH, MICROBATCHES, DP = 5, 6, 16, 4, 2
VAL_SAMPLES, TEST_SAMPLES, PREDICT_SAMPLES = 32, 48, 32
STEP_METRICS = ("train/loss", "train/accuracy")


class MetricMLP(TinyMLP):
    """Logs loss and accuracy under its own names: from its steps in one process, from the pipeline hooks otherwise.

    The hooks count their calls, to show where they run.
    """

    def __init__(self) -> None:
        super().__init__()
        self.hook_calls = 0

    def log_metrics(self, stage: str, loss: torch.Tensor, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.log(f"{stage}/loss", loss, sync_dist=True)
        self.log_dict({f"{stage}/accuracy": (outputs.argmax(dim=-1) == targets).float().mean()}, sync_dist=True)

    def _step(self, stage: str, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        outputs = self(batch[0])
        loss = self.pipeline_loss(outputs, batch[1])
        self.log_metrics(stage, loss.detach(), outputs.detach(), batch[1])
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step("train", batch)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step("val", batch)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step("test", batch)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log_dict(grad_norm(self, norm_type=2))  # each stage's parameters' norms, and their total

    def pipeline_training_step(self, loss: torch.Tensor, outputs: torch.Tensor, targets: torch.Tensor, _: int) -> None:
        self.hook_calls += 1
        self.log_metrics("train", loss, outputs, targets)

    def pipeline_validation_step(
        self, loss: torch.Tensor, outputs: torch.Tensor, targets: torch.Tensor, _: int
    ) -> None:
        self.hook_calls += 1
        self.log_metrics("val", loss, outputs, targets)

    def pipeline_test_step(self, loss: torch.Tensor, outputs: torch.Tensor, targets: torch.Tensor, _: int) -> None:
        self.hook_calls += 1
        self.log_metrics("test", loss, outputs, targets)


class StepMetrics(L.Callback):
    """What Lightning holds for the step metrics after each training step, one after the other."""

    def __init__(self) -> None:
        self.steps: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *_args: Any) -> None:
        self.steps.extend(float(trainer.callback_metrics[name]) for name in STEP_METRICS)


def _trainer(strategy: Any, **kwargs: Any) -> L.Trainer:
    nodes = {} if strategy == "auto" else {"num_nodes": 4}
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=STEPS,
        gradient_clip_val=0.3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **nodes,
        **kwargs,
    )


def _loaders(batch_size: int, single_process: bool = False) -> dict[str, DataLoader]:
    predict_inputs = TensorDataset(tiny_dataset(PREDICT_SAMPLES).tensors[0])
    return {
        "train": tiny_loader(STEPS * GLOBAL_BATCH, batch_size, single_process_seed=SEED if single_process else None),
        "val": tiny_loader(VAL_SAMPLES, batch_size, shuffle=False),
        "test": DataLoader(tiny_dataset(TEST_SAMPLES), batch_size=batch_size),
        "predict": DataLoader(predict_inputs, batch_size=batch_size),
    }


def _evaluate(trainer: L.Trainer, model: L.LightningModule, loaders: dict[str, DataLoader]) -> dict[str, Any]:
    """validate, test and predict; predictions gathered in the DataLoader's order (one process: concatenated)."""
    predictions = trainer.predict(model, loaders["predict"])
    strategy = trainer.strategy
    gathered = strategy.gather_predictions(predictions) if isinstance(strategy, HolmesStrategy) else None
    return {
        "validate": trainer.validate(model, loaders["val"], verbose=False)[0],
        "test": trainer.test(model, loaders["test"], verbose=False)[0],
        "predict": (torch.cat(predictions) if gathered is None else gathered).tolist(),
        "inference_mode": [loop.inference_mode for loop in (trainer.validate_loop, trainer.predict_loop)],
    }


def _fit_and_evaluate(strategy: Any, batch_size: int, checkpoint: str | None = None) -> dict[str, Any]:
    L.seed_everything(SEED)
    model, recorder, loaders = MetricMLP(), StepMetrics(), _loaders(batch_size, single_process=strategy == "auto")
    trainer = _trainer(strategy, callbacks=[recorder])
    trainer.fit(model, loaders["train"], loaders["val"])
    if checkpoint is not None:
        trainer.save_checkpoint(checkpoint)
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    fitted = {"steps": recorder.steps, "metrics": metrics, "logged": sorted(trainer.logged_metrics)}
    return {**fitted, **_evaluate(trainer, model, loaders)}


def _on_their_own(strategy: Any, batch_size: int) -> dict[str, Any]:
    L.seed_everything(SEED)
    model = MetricMLP()
    return {**_evaluate(_trainer(strategy), model, _loaders(batch_size)), "hook_calls": model.hook_calls}


def _strategy() -> HolmesStrategy:
    return HolmesStrategy(
        cluster="two_cluster_mixed",
        schedule="1F1B",
        pp=2,
        dp=DP,
        global_batch=GLOBAL_BATCH,
        microbatches=MICROBATCHES,
        timeout=120,
    )


def pipelined_runs(checkpoint: str) -> dict[str, Any]:
    """Rank side: fit with the hooks, then validate/test/predict; then all three on a fresh Trainer and model, and
    validation of the fitted checkpoint on another fresh one."""
    strategy, batch_size = _strategy(), GLOBAL_BATCH // DP
    fitted = _fit_and_evaluate(strategy, batch_size, checkpoint)
    alone = _on_their_own(_strategy(), batch_size)
    L.seed_everything(SEED + 1)  # other initial weights: the checkpoint's must replace them
    restored = _trainer(_strategy()).validate(MetricMLP(), _loaders(batch_size)["val"], ckpt_path=checkpoint)[0]
    calibrated = strategy.calibration
    closing = [calibrated.costs.closing_s, *(stage.closing_s for stage in strategy.plan.stages)]
    return {
        "fit": fitted,
        "alone": alone,
        "restored": restored,
        "last_stage": strategy.pipeline.is_last,
        "closing": closing,
        "message_cpu_s": calibrated.costs.message_cpu_s,
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    checkpoint = str(tmp_path_factory.mktemp("fitted") / "fitted.ckpt")
    return run_ranks("test_hooks:pipelined_runs", timeout_s=600, checkpoint=checkpoint)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return {"fit": _fit_and_evaluate("auto", GLOBAL_BATCH), "alone": _on_their_own("auto", GLOBAL_BATCH)}


@pytest.mark.slow
def test_metrics_logged_by_the_pipeline_hooks_match_one_process(ranks: list[dict], reference: dict) -> None:
    assert len(reference["fit"]["steps"]) == STEPS * len(STEP_METRICS)
    for rank, result in enumerate(ranks):
        assert result["fit"]["steps"] == pytest.approx(reference["fit"]["steps"], rel=1e-4), f"rank {rank}"
        assert result["fit"]["metrics"] == pytest.approx(reference["fit"]["metrics"], rel=1e-4), f"rank {rank}"
        assert {"train/accuracy", "val/accuracy"} <= set(result["fit"]["logged"]), "loggers get them on every rank"
        assert "train_loss" not in result["fit"]["logged"], "a module with hooks logs under its own names only"


@pytest.mark.slow
@pytest.mark.parametrize("run", ["fit", "alone"])
def test_validate_test_and_predict_match_one_process(run: str, ranks: list[dict], reference: dict) -> None:
    expected = reference[run]
    for rank, result in enumerate(ranks):
        assert result[run]["validate"] == pytest.approx(expected["validate"], rel=1e-4), f"rank {rank}"
        assert result[run]["test"] == pytest.approx(expected["test"], rel=1e-4), f"rank {rank}"
        assert torch.tensor(result[run]["predict"]).allclose(torch.tensor(expected["predict"]), rtol=1e-4, atol=1e-6)
        assert result[run]["inference_mode"] == [False, False], "evaluation runs under no_grad (FSDP2 on NCCL)"


@pytest.mark.slow
def test_a_fitted_checkpoint_validates_on_its_own_like_the_fitted_model(ranks: list[dict], reference: dict) -> None:
    for rank, result in enumerate(ranks):
        assert result["restored"] == pytest.approx(reference["fit"]["validate"], rel=1e-4), f"rank {rank}"


@pytest.mark.slow
def test_the_hooks_run_on_the_last_stage_only(ranks: list[dict]) -> None:
    """validate (2 batches of 8 per replica) and test (3 batches) called the hooks on last-stage ranks only."""
    assert [r["alone"]["hook_calls"] for r in ranks] == [5 if r["last_stage"] else 0 for r in ranks]
    assert sum(r["last_stage"] for r in ranks) == DP


def test_the_last_stage_keeps_outputs_only_for_a_hook_that_takes_them() -> None:
    class ValidationMetrics(TinyMLP):
        def pipeline_validation_step(self, loss: torch.Tensor, outputs: torch.Tensor, *_: Any) -> None:
            self.log("val/max_logit", outputs.max())

    assert [step_hook(TinyMLP(), step) for step in ("training_step", "validation_step", "test_step")] == [None] * 3
    module = ValidationMetrics()
    assert step_hook(module, "training_step") is None and step_hook(module, "test_step") is None
    assert step_hook(module, "validation_step") == module.pipeline_validation_step


def test_a_users_own_step_that_a_pipeline_replaces_is_named_once(caplog: pytest.LogCaptureFixture) -> None:
    class Accuracy(TinyMLP):  # logs more than its loss from its own validation_step, without a pipeline hook
        def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
            self.log("val_acc", (self(batch[0]).argmax(-1) == batch[1]).float().mean())

    class Recipe(GPT):  # our own steps log only the loss
        pass

    with caplog.at_level(logging.INFO):
        for module in (Accuracy(), Accuracy(), Recipe(n_layers=1, d_model=8, n_heads=1, seq_len=4, vocab_size=8)):
            _say_the_step_does_not_run(module, "validation_step")
    said = [record.getMessage() for record in caplog.records if "does not run" in record.getMessage()]
    assert said == [
        "HolmesStrategy: Accuracy.validation_step does not run under pipeline stages: the schedule computes the loss, "
        "logged as 'val_loss'; to log anything else, define pipeline_validation_step(self, loss, outputs, targets, "
        "batch_idx), which replaces that default"
    ]


def two_chunk_plan() -> Plan:
    """Both virtual stages of an Interleaved1F1B pipeline on one rank."""
    stage = StagePlan(
        index=0,
        ranks=(0,),
        chunks=((0, 3), (3, 6)),
        clusters=("A",),
        nics=(NICKind.ethernet,),
        dp_link=LinkKind.TCP,
        send_link=LinkKind.TCP,
    )
    return Plan(
        layout="holmes",
        schedule="Interleaved1F1B",
        stages=(stage,),
        microbatches=2,
        microbatch_size=2,
        prediction=StepPrediction(0.0, 0.0, 0.0, 0.0, 0.0),
        num_layers=6,
        pp_links=(LinkKind.TCP,),
    )


def test_a_step_leaves_no_outputs_behind_and_returns_them_only_when_asked(tmp_path: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = TinyMLP()
        chunks = [nn.Sequential(*model.layers[start:stop]) for start, stop in two_chunk_plan().stages[0].chunks]
        pipeline = Pipeline(
            plan=two_chunk_plan(),
            stage=0,
            chunks=chunks,
            pp_group=dist.group.WORLD,
            device=torch.device("cpu"),
            loss_fn=model.pipeline_loss,
        )
        inputs, targets = tiny_dataset(4).tensors

        def left_behind() -> bool:  # in any PipelineStage the pipeline built
            stages = [stage for schedule in pipeline._schedules.values() for stage in schedule.stages]
            return any(stage.output_chunks or stage.fwd_cache for stage in stages)

        assert pipeline.train_step((inputs,), targets).outputs is None
        assert not left_behind()
        kept = pipeline.train_step((inputs,), targets, keep_outputs=True)
        assert not left_behind()
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(kept.outputs, model(inputs).detach())


def test_fp16_loss_scaling_is_refused_when_the_trainer_is_built() -> None:
    def build(**precision: Any) -> L.Trainer:
        strategy = HolmesStrategy(cluster="two_cluster_mixed", global_batch=8)
        return L.Trainer(accelerator="cpu", num_nodes=4, strategy=strategy, **precision)

    with pytest.raises(ValueError, match=r"precision='16-mixed'.*use precision='bf16-mixed'"):
        build(plugins=[MixedPrecision("16-mixed", "cpu")])
    with pytest.raises(ValueError, match=r"precision='16-mixed'.*bf16-mixed"):  # Lightning's own check comes first
        build(precision="16-mixed")


class ManualMLP(TinyMLP):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def test_manual_optimization_with_a_pipeline_is_refused_before_any_process_group() -> None:
    strategy = HolmesStrategy(cluster="two_cluster_mixed", pp=2, global_batch=8)
    with mock.patch.dict(os.environ), pytest.raises(ValueError, match=r"pp=2 needs Lightning's automatic optim"):
        _trainer(strategy).fit(ManualMLP(), tiny_loader(8, 4))
    assert not dist.is_initialized()


@pytest.mark.slow
def test_a_steps_closing_collectives_and_a_messages_cpu_are_measured_at_job_start(ranks: list[dict]) -> None:
    """The loss's all-reduce and Lightning's stop broadcast (no clipping, no HolmesCheckpoint): every rank measured
    the same seconds, and every stage of the plan closes with them; a message's CPU, alike on every rank."""
    measured = ranks[0]["closing"][0]
    assert 0 < measured < 1
    assert all(result["closing"] == [measured] * (1 + 2) for result in ranks)
    assert 0 < ranks[0]["message_cpu_s"] < 1
    assert len({result["message_cpu_s"] for result in ranks}) == 1
