"""A user's own training script, not from recipes/: `python user_script.py OUT_DIR`.

The same file runs unchanged under Lightning's launcher (`python user_script.py OUT`, `devices=4` starts the other
three processes), `torchrun --standalone --nproc-per-node 4 user_script.py OUT` and
`holmes-launch cluster=two_cluster_mixed -- python user_script.py OUT`. Each rank writes the loss of every training
step to OUT/rank<N>.json.

`python user_script.py OUT registered`: `Trainer(strategy="holmes")` on `$HOLMES_CLUSTER`, no global batch given,
no `example_input_array`, and a DataLoader of its own batch size split by `distributed_sampler_kwargs`, as a
DDP script writes it; OUT/rank<N>.json then also holds the plan's DP degree.

`python user_script.py OUT diloco` (under `holmes-launch cluster=two_sites_1gbps sites=auto`): the same DDP-style
module, each site one replica of FSDP2 over its 2 ranks, DiLoCo every 3 steps with bf16 pseudo-gradients; each site
saves OUT/site-<NAME>/last.ckpt at the end (an outer step) and its ranks' losses beside it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from holmes_lightning import HolmesStrategy
from holmes_lightning.planner.sites import DiLoCoSettings

SEED, STEPS, GLOBAL_BATCH, FEATURES, CLASSES = 11, 6, 8, 12, 3
LOADER_BATCH = 4  # the registered run's DataLoader: samples per DP replica per step


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(128, FEATURES, generator=generator)
    return TensorDataset(inputs, (inputs[:, :CLASSES] * inputs[:, CLASSES : 2 * CLASSES]).argmax(dim=1))


class GatedClassifier(L.LightningModule):
    """Three gated blocks and a head, written as pipeline layers; `training_step` is its plain one-process step."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Gated(FEATURES if i == 0 else 24, 24) for i in range(3))
        self.head = nn.Linear(24, CLASSES)
        self.example_input_array = torch.zeros(2, FEATURES)

    def pipeline_layers(self) -> list[nn.Module]:
        return [*self.blocks, self.head]

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(outputs, targets)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        for layer in self.pipeline_layers():
            inputs = layer(inputs)
        return inputs

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.pipeline_loss(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        """Each DP replica's share of the global batch (the plan's DP degree is known by now)."""
        return DataLoader(dataset(), batch_size=self.trainer.strategy.replica_batch_size, shuffle=True)


class DDPStyleClassifier(GatedClassifier):
    """The same model as a DDP user writes its data: a DataLoader of a fixed batch size, split by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = None

    def train_dataloader(self) -> DataLoader:
        data = dataset()
        sampler = DistributedSampler(data, shuffle=True, seed=SEED, **self.trainer.strategy.distributed_sampler_kwargs)
        return DataLoader(data, batch_size=LOADER_BATCH, sampler=sampler)


class Gated(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.value, self.gate = nn.Linear(width_in, width_out), nn.Linear(width_in, width_out)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.value(inputs) * torch.sigmoid(self.gate(inputs))


class StepLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def main(out: str, mode: str | None = None) -> None:
    L.seed_everything(SEED)
    model, losses = (GatedClassifier() if mode is None else DDPStyleClassifier()), StepLosses()
    strategy: str | HolmesStrategy = "holmes"
    if mode is None:
        strategy = HolmesStrategy(cluster="two_cluster_mixed", global_batch=GLOBAL_BATCH, pp=2)
    elif mode == "diloco":
        diloco = DiLoCoSettings(sync_every=3, outer_bits=16)
        strategy = HolmesStrategy(
            cluster="two_sites_1gbps", cross_site="diloco", diloco=diloco, pp=1, dp=2, sharding="fsdp"
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2 if mode == "diloco" else 4,
        strategy=strategy,
        max_steps=STEPS,
        callbacks=[losses],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    name = f"rank{trainer.global_rank}"
    if mode == "diloco":  # a folder per site: each site is a job of its own, and a job owns its checkpoints' folder
        out, name = str(Path(out, f"site-{trainer.strategy.site.label}")), f"site-{trainer.strategy.site.label}-{name}"
        trainer.save_checkpoint(Path(out, "last.ckpt"))
    written = {"losses": losses.losses, "dp": trainer.strategy.plan.dp} if mode == "registered" else losses.losses
    Path(out, f"{name}.json").write_text(json.dumps(written))


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:3])
