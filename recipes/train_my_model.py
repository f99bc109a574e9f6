"""Your own LightningModule under HolmesStrategy, on one machine: `python recipes/train_my_model.py`.

It runs unchanged as `torchrun --standalone --nproc-per-node 4 recipes/train_my_model.py`, or with the lab's emulated
InfiniBand / RoCE / Ethernet links as `holmes-launch cluster=two_cluster_mixed lab=emulate -- python
recipes/train_my_model.py` (root). On real clusters, start it on every node with torchrun or srun instead.
"""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from holmes_lightning import HolmesStrategy


class MyModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def pipeline_layers(self):  # applied in order, they map inputs to outputs; each stage gets a run of them
        return list(self.layers)

    def pipeline_loss(self, outputs, targets):  # the mean loss of one micro-batch
        return nn.functional.cross_entropy(outputs, targets)

    def training_step(self, batch, batch_idx):  # used as is when the plan has a single stage
        return self.pipeline_loss(self.layers(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):  # every rank builds the same data; each DP replica reads its share of a batch
        inputs = torch.randn(4096, 32, generator=torch.Generator().manual_seed(0))
        data = TensorDataset(inputs, inputs[:, :10].argmax(dim=1))
        return DataLoader(data, batch_size=self.trainer.strategy.replica_batch_size, shuffle=True)


if __name__ == "__main__":
    L.seed_everything(0)
    strategy = HolmesStrategy(cluster="two_cluster_mixed", global_batch=32)  # 4 nodes: 2 InfiniBand, 2 RoCE
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=30)  # devices: the cluster's ranks
    trainer.fit(MyModel())
