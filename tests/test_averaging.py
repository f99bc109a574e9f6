"""Lightning's weight-averaging callbacks under HolmesStrategy: `EMAWeightAveraging` and `StochasticWeightAveraging`
average each rank's own stage shards, and their averages go through the checkpoint and back.

A tagger that is none of ours (embedding, residual blocks, a head) trains on pp=2 x dp=2 (two_cluster_mixed; FSDP
shards, whose modules refuse `deepcopy`, or replicas) and on one stage of FSDP shards (single_node: the module's own
forward), three epochs straight and again resumed from its second epoch's checkpoint (the average already under
way): the training losses, and the validation loss of the weights the callback leaves at the end (its average), must
equal one process's.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from distributed import LossRecorder, run_ranks
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from holmes_lightning import HolmesStrategy
from holmes_lightning.planner import PlanOptions
from holmes_lightning.runtime.averaging import counted

GLOBAL_BATCH = 16
SEED = 5


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.gelu(self.linear(self.norm(x)))


class Tagger(L.LightningModule):
    """A token tagger: each token's class is its id modulo 5."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(50, 32), nn.Linear(32, 5)
        self.blocks = nn.ModuleList(Block(32) for _ in range(3))

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(outputs.flatten(0, 1), targets.flatten())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        for layer in self.pipeline_layers():
            tokens = layer(tokens)
        return tokens

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.pipeline_loss(self(batch[0]), batch[1])

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.pipeline_loss(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def loader(samples: int, seed: int, batch_size: int, one_process_order: bool = False) -> DataLoader:
    """Token rows; `one_process_order`: in the order Lightning's seeded DistributedSampler gives the replicas of a
    training DataLoader together (it shuffles those), so that one batch here is their global batch."""
    tokens = torch.randint(50, (samples, 12), generator=torch.Generator().manual_seed(seed))
    data = TensorDataset(tokens, tokens % 5)
    order = DistributedSampler(data, num_replicas=1, rank=0, seed=SEED) if one_process_order else None
    return DataLoader(data, batch_size=batch_size, sampler=order)


def averaging(name: str) -> Callback:
    if name == "ema":
        return EMAWeightAveraging(decay=0.8)
    return StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)


def fit(
    name: str, strategy: Any, ranks: tuple[int, int], save: str | None = None, resume: str | None = None
) -> dict[str, Any]:
    """Three epochs with the `name` averaging callback on `ranks` (nodes, devices per node), from `resume` (a
    checkpoint) if given, saving every epoch into `save` if given: the losses, and the validation loss of the weights
    the callback leaves."""
    L.seed_everything(SEED)
    recorder = LossRecorder()
    callbacks = [recorder, averaging(name)]
    if save is not None:
        callbacks.append(ModelCheckpoint(dirpath=save, save_top_k=-1, save_on_train_epoch_end=True))
    trainer = L.Trainer(
        accelerator="cpu",
        num_nodes=ranks[0],
        devices=ranks[1],
        strategy=strategy,
        max_epochs=3,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=save is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    one_process = ranks == (1, 1)
    replica_batch = GLOBAL_BATCH if one_process else GLOBAL_BATCH // 2  # every job below has dp=2
    model, validation = Tagger(), loader(32, 1, replica_batch)
    trainer.fit(model, loader(64, 0, replica_batch, one_process_order=one_process), validation, ckpt_path=resume)
    return {"losses": recorder.losses, "val_loss": trainer.validate(model, validation, verbose=False)[0]["val_loss"]}


def straight_and_resumed(name: str, job: dict[str, Any], root: str) -> dict[str, Any]:
    """On a rank: three epochs straight, then again from the second epoch's checkpoint."""
    ranks = (job["nodes"], job["devices"])

    def strategy() -> HolmesStrategy:
        settings = {key: job[key] for key in ("pp", "schedule", "sharding")}
        return HolmesStrategy(cluster=job["cluster"], global_batch=GLOBAL_BATCH, **settings)

    saved = os.path.join(root, name)
    straight = fit(name, strategy(), ranks, save=saved)
    return {"straight": straight, "resumed": fit(name, strategy(), ranks, resume=second_epoch(saved))}


def second_epoch(directory: str) -> str:
    return os.path.join(directory, sorted(os.listdir(directory))[1])


PIPELINE = {"cluster": "two_cluster_mixed", "nodes": 4, "devices": 1, "pp": 2}
ONE_STAGE = {"cluster": "single_node", "nodes": 1, "devices": 2, "pp": 1}  # the module's own forward, no pipeline


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "job"),
    [
        ("ema", {**PIPELINE, "schedule": "ZBVZeroBubble", "sharding": "fsdp"}),
        ("swa", {**PIPELINE, "schedule": "1F1B", "sharding": "none"}),
        ("ema", {**ONE_STAGE, "schedule": "1F1B", "sharding": "none"}),
    ],
    ids=["ema-pipeline-fsdp", "swa-pipeline-replicas", "ema-one-stage-replicas"],
)
def test_an_averaging_callback_averages_the_stages_and_resumes_as_one_process(
    tmp_path: Any, name: str, job: dict[str, Any]
) -> None:
    ranks = run_ranks(
        "test_averaging:straight_and_resumed",
        cluster=job["cluster"],
        name=name,
        job=job,
        root=str(tmp_path),
        env={"HOLMES_CALIBRATION_SECONDS": "0.05"},
    )
    one = fit(name, "auto", (1, 1), save=str(tmp_path / "one"))
    one_resumed = fit(name, "auto", (1, 1), resume=second_epoch(str(tmp_path / "one")))
    for run, expected in (("straight", one), ("resumed", one_resumed)):
        # a pipeline's ranks each report the global batch's loss, a one-stage job's its own replica's: the mean over
        # ranks is the global batch's
        losses = [sum(step) / len(ranks) for step in zip(*(rank[run]["losses"] for rank in ranks), strict=True)]
        assert losses == pytest.approx(expected["losses"], rel=1e-4), run
        for rank in ranks:
            assert rank[run]["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-4), run
    assert one_resumed["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6)  # the average came back whole


def test_the_plan_counts_an_average_kept_on_the_training_device() -> None:
    options, gpu = PlanOptions(), torch.device("cuda", 1)
    assert counted(options, [ModelCheckpoint()], gpu) == options
    assert counted(options, [EMAWeightAveraging(), ModelCheckpoint()], gpu).state_multiplier == 5.0  # AdamW's 4 + 1
    assert counted(options, [EMAWeightAveraging(device="cuda")], gpu).state_multiplier == 5.0
    assert counted(options, [EMAWeightAveraging(device="cpu")], gpu) == options  # in host memory
    assert counted(options, [StochasticWeightAveraging(swa_lrs=0.01)], gpu) == options  # SWA keeps it on the CPU
    assert counted(options, [StochasticWeightAveraging(swa_lrs=0.01, device=None)], gpu).state_multiplier == 5.0
