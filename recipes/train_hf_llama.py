"""A Hugging Face Llama trained across two_cluster_mixed's InfiniBand and RoCE nodes:
`python recipes/train_hf_llama.py`.

It runs unchanged as `torchrun --standalone --nproc-per-node 4 recipes/train_hf_llama.py`. Any transformers
`*ForCausalLM` built the common way trains the same (`HFCausalLM(config)`, a model, or a pretrained directory built
under `trainer.init_module(empty_init=True)`, each rank then reading only its stage's weights).
"""

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler
from transformers import LlamaConfig

from holmes_lightning import HolmesStrategy
from holmes_lightning.hf import HFCausalLM


class MyLlama(HFCausalLM):
    def train_dataloader(self):  # rows that count up from a random start: each DP replica reads its share
        rows = (torch.arange(64) + torch.randint(256, (1024, 1), generator=torch.Generator().manual_seed(0))) % 256
        data = [{"input_ids": row, "labels": row} for row in rows]
        sampler = DistributedSampler(data, **self.trainer.strategy.distributed_sampler_kwargs)
        return DataLoader(data, batch_size=self.trainer.strategy.replica_batch_size, sampler=sampler)


if __name__ == "__main__":
    L.seed_everything(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
    config = LlamaConfig(vocab_size=256, **shape)
    strategy = HolmesStrategy(cluster="two_cluster_mixed", global_batch=16, pp=2)  # 2 IB + 2 RoCE nodes, 2 stages
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=30, logger=False)
    trainer.fit(MyLlama(config, learning_rate=3e-3))
    strategy.save_hf("trained-llama")  # on every rank: AutoModelForCausalLM.from_pretrained("trained-llama")
