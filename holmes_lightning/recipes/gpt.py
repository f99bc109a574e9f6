"""A nanoGPT-sized GPT as a LightningModule, written as a list of pipeline layers: embedding, blocks, head.

Too big for one rank? Build it on the meta device (`with trainer.init_module(empty_init=True): GPT(...)`):
HolmesStrategy then allocates on each rank only the layers of its stage and initialises them with `init_layer`,
each from its own seed, exactly as `__init__` initialises the whole model on one process.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import Metric

from holmes_lightning import init_layers


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=2)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, d_model)
        return self.proj_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class Embedding(nn.Module):
    """Token ids (B, T) -> token + position embeddings (B, T, d_model)."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        return self.dropout(self.tokens(idx) + self.positions(positions))


class Head(nn.Module):
    """Hidden states (B, T, d_model) -> logits (B, T, vocab); not tied to the embedding (they may sit on two stages)."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(x))


class LossPerplexity(Metric):
    """exp of the mean of per-batch mean cross-entropies (equal batches: the token-level perplexity).

    Fed with losses, not logits, so it also works where only the last pipeline stage sees logits. Updates are
    out-of-place (unlike MeanMetric's), so states reset under `Trainer.validate`'s inference mode still update in `fit`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.add_state("loss_sum", torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("batches", torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, loss: torch.Tensor) -> None:
        self.loss_sum = self.loss_sum + loss.detach().float()
        self.batches = self.batches + 1

    def compute(self) -> torch.Tensor:
        return (self.loss_sum / self.batches).exp()


class GPT(L.LightningModule):
    """Decoder-only transformer trained with AdamW and a warmup + cosine learning-rate schedule.

    GPT-2's initialisation (`init_layer`): weights ~ N(0, 0.02), the residual projections scaled down by depth,
    biases zero, layer norms at identity.
    """

    def __init__(
        self,
        n_layers: int = 4,
        d_model: int = 128,
        n_heads: int = 4,
        seq_len: int = 128,
        vocab_size: int = 256,
        dropout: float = 0.0,
        learning_rate: float = 3e-3,
        warmup_steps: int = 5,
        weight_decay: float = 0.1,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embedding = Embedding(vocab_size, seq_len, d_model, dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.head = Head(d_model, vocab_size)
        with torch.device("cpu"):  # not weights: real tensors even when the model is built on the meta device
            self.val_ppl = LossPerplexity()  # fed from each validation batch's loss, so pipelined runs get it too
            self.example_input_array = torch.zeros(1, seq_len, dtype=torch.long)  # one sequence: profiling, summary
        init_layers(self)  # each layer from its own seed; on meta, HolmesStrategy does it for the layers a rank keeps

    def init_layer(self, layer: nn.Module) -> None:
        """GPT-2's initialisation of one pipeline layer (called once per layer, its random draws seeded for it)."""
        for module in layer.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        if isinstance(layer, Block):  # the residual projections, scaled by depth
            for proj in (layer.attn.proj, layer.mlp.proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * self.hparams.n_layers))

    def pipeline_layers(self) -> list[nn.Module]:
        """[embedding, block x n_layers, head]: applied in order they map token ids (B, T) to logits (B, T, V)."""
        return [self.embedding, *self.blocks, self.head]

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of one (micro-)batch."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = self.pipeline_loss(self(inputs), targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = self.pipeline_loss(self(inputs), targets)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def on_validation_batch_end(self, outputs: torch.Tensor, *_args: object) -> None:
        self.val_ppl.update(outputs)
        self.log("val_ppl", self.val_ppl, prog_bar=True)

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        matrices = [p for p in self.parameters() if p.dim() >= 2]  # weights and embeddings decay; biases, norms don't
        vectors = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": hp.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
        # fused: the step allocates nothing the size of the model (the foreach default on GPUs allocates a copy)
        optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=(0.9, 0.95), fused=True)
        total = max(self.trainer.estimated_stepping_batches, hp.warmup_steps + 1)
        warmup = torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=1 / (hp.warmup_steps + 1), total_iters=hp.warmup_steps
        )
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=total - hp.warmup_steps, eta_min=hp.learning_rate * hp.min_lr_ratio
        )
        schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[hp.warmup_steps])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    @property
    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward): 6 x matmul weights + 12 x layers x d_model x seq_len.

        From the shapes, not from `parameters()`, so it stays the whole model's count when a pipeline stage holds
        only some layers.
        """
        hp = self.hparams
        matmul_weights = hp.n_layers * 12 * hp.d_model**2 + hp.d_model * hp.vocab_size
        return 6 * matmul_weights + 12 * hp.n_layers * hp.d_model * hp.seq_len
