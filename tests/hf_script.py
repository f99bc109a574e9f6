"""A user's script training Hugging Face causal LMs across two_cluster_mixed: `python hf_script.py FAMILY SCHEDULE
PADDING OUT [PRETRAINED_DIR]`, or one after another in the same processes: `python hf_script.py --cases OUT
FAMILY,SCHEDULE,PADDING[,PRETRAINED_DIR] ...` (each into OUT/FAMILY-SCHEDULE-PADDING, `-pretrained` added with a
directory).

pp=2 x dp=2 (Lightning's launcher starts the 4 processes), dict batches from a DataLoader that splits its data with
`DistributedSampler(**trainer.strategy.distributed_sampler_kwargs)`, no `example_input_array`. FAMILY+lora: that
model with a DoRA adapter (peft) on its attention's query and value projections and a trained copy of its LM head,
the rest frozen. Rows are padded on the `PADDING` side ("right" or "left") with `labels=-100` there and at a few
other places. Each rank writes OUT/rank<N>.json: its per-step losses, and the tied embedding's values where it holds a
copy; then every rank saves the trained model with `trainer.strategy.save_hf(OUT/hf)`. With PRETRAINED_DIR the model
is built on the meta device from that directory and each rank loads only its stage's layers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import transformers as tf
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from holmes_lightning import HolmesStrategy
from holmes_lightning.hf import HFCausalLM

SEED, STEPS, GLOBAL_BATCH, VOCAB, LENGTH = 7, 5, 8, 64, 10
LLAMA_LIKE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=32,
    pad_token_id=0,
)
GPT2_LIKE = dict(n_embd=32, n_layer=3, n_head=4, n_positions=32, vocab_size=VOCAB)
CONFIGS = {  # no dropout: one process and the pipeline then compute alike
    "gpt2": lambda: tf.GPT2Config(**GPT2_LIKE, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0),
    "llama": lambda: tf.LlamaConfig(**LLAMA_LIKE, tie_word_embeddings=True),  # grouped-query attention, RoPE, tied
    "qwen2": lambda: tf.Qwen2Config(**LLAMA_LIKE, tie_word_embeddings=False),  # qkv bias, untied
    "gemma": lambda: tf.GemmaConfig(**LLAMA_LIKE, head_dim=8),  # scaled embedding, (1 + w) norms, tied
    "gptj": lambda: tf.GPTJConfig(  # every layer looks its rotary sin/cos up by position id
        **GPT2_LIKE, rotary_dim=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=1, eos_token_id=2
    ),
    "bloom": lambda: tf.BloomConfig(  # ALiBi biases from the padding mask in every layer, a norm of the embeddings
        hidden_size=32, n_layer=3, n_head=4, vocab_size=VOCAB, hidden_dropout=0, attention_dropout=0, pad_token_id=0
    ),
    "opt": lambda: tf.OPTConfig(  # positions at position id + 2, tied
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        vocab_size=VOCAB,
        word_embed_proj_dim=32,
        max_position_embeddings=32,
        dropout=0,
        attention_dropout=0,
        pad_token_id=0,
    ),
    "gpt_bigcode": lambda: tf.GPTBigCodeConfig(**GPT2_LIKE, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0),
}


def config(family: str) -> tf.PretrainedConfig:
    """The config of `family`, with or without "+lora"."""
    return CONFIGS[family.partition("+")[0]]()


def adapter(family: str) -> Any:
    """For "FAMILY+lora", the adapter's peft config (LoRA's weight-decomposed variant, DoRA, and a trained copy of the
    LM head, which peft saves whole), else None."""
    if not family.endswith("+lora"):
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, use_dora=True, modules_to_save=["lm_head"]
    )


class PaddedTokens(Dataset):
    """Random token rows of random lengths, padded on one side; labels -100 on the padding and on a few tokens."""

    def __init__(self, padding: str, rows: int = 64) -> None:
        generator = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, VOCAB, (rows, LENGTH), generator=generator)
        self.lengths = torch.randint(3, LENGTH + 1, (rows,), generator=generator)
        self.ignored = torch.rand(rows, LENGTH, generator=generator) < 0.1
        self.padding = padding

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        mask = torch.zeros(LENGTH, dtype=torch.long)
        length = int(self.lengths[index])
        if self.padding == "left":
            mask[LENGTH - length :] = 1
        else:
            mask[:length] = 1
        ids = self.ids[index].masked_fill(mask == 0, 0)
        labels = ids.masked_fill((mask == 0) | self.ignored[index], -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class MyCausalLM(HFCausalLM):
    """An HF causal LM with the data loading a Lightning user writes."""

    def __init__(self, source: Any, padding: str, peft_config: Any = None) -> None:
        super().__init__(source, peft_config=peft_config, learning_rate=3e-3)
        self.padding = padding

    def train_dataloader(self) -> DataLoader:
        data = PaddedTokens(self.padding)
        sampler = DistributedSampler(data, shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs)
        return DataLoader(data, batch_size=self.trainer.strategy.replica_batch_size, sampler=sampler)


class StepLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def tied_copy(module: HFCausalLM) -> list[float] | None:
    """This rank's copy of the tied embedding (the embedding's, else the head's), whole; None without one."""
    for layer, name in ((module.layers[0], "tokens.weight"), (module.layers[-1], "lm_head.weight")):
        if layer is not None and module.hf_model.config.tie_word_embeddings:
            weight = layer.get_parameter(name)
            return (weight.full_tensor() if isinstance(weight, DTensor) else weight).flatten().tolist()
    return None


def main(family: str, schedule: str, padding: str, out: str, pretrained: str | None = None) -> None:
    L.seed_everything(SEED)
    strategy = HolmesStrategy(cluster="two_cluster_mixed", global_batch=GLOBAL_BATCH, pp=2, schedule=schedule)
    losses = StepLosses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=STEPS,
        callbacks=[losses],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with trainer.init_module(empty_init=pretrained is not None):
        model = MyCausalLM(pretrained or config(family), padding, peft_config=adapter(family))
    trainer.fit(model)
    result = {"losses": losses.losses, "tied": tied_copy(model), "plan": [len(s.layers) for s in strategy.plan.stages]}
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    strategy.save_hf(Path(out, "hf"))


def case_dir(out: str, family: str, schedule: str, padding: str, pretrained: str | None = None) -> str:
    return str(Path(out, f"{family}-{schedule}-{padding}" + ("-pretrained" if pretrained else "")))


if __name__ == "__main__":
    if sys.argv[1] == "--cases":
        for case in sys.argv[3:]:
            family, schedule, padding, *pretrained = case.split(",")
            main(family, schedule, padding, case_dir(sys.argv[2], family, schedule, padding, *pretrained), *pretrained)
    else:
        main(*sys.argv[1:])
