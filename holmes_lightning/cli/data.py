"""What train.py trains on: the standard library's sources as bytes (the default), a local text file
(`data.text_file`), a `datasets` dataset saved on disk (`data.dataset_dir`) or your LightningDataModule
(`data._target_`).

Text is tokenised by the pretrained HF model's tokenizer when its directory holds one, else taken as bytes. Built-in
data yields `(inputs, targets)` for the GPT, HF's dicts for HF models, and either for your module (`data.batch_format`,
pairs by default); each DP replica gets its share of `data.global_batch` (`trainer.strategy.replica_batch_size`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L

from holmes_lightning.cli.config import BatchFormat, ConfigError, HFModelConfig, ModelConfig, TrainConfig
from holmes_lightning.cli.targets import build_target, check_target
from holmes_lightning.recipes.data import StdlibBytes, TokenDataModule, TokenSource
from holmes_lightning.recipes.text import (
    SavedDataset,
    TextFile,
    chosen_column,
    has_tokenizer,
    load_tokenizer,
    saved_dataset,
)

BYTES = 256  # the vocabulary bytes need


def tokenizer_dir(config: TrainConfig) -> str | None:
    """The directory whose tokenizer tokenises a text file or dataset: the pretrained HF model's, if it holds one;
    None: bytes (the standard library's corpus is bytes whatever the model)."""
    model, data = config.model, config.data
    reads_text = data.text_file is not None or data.dataset_dir is not None
    if reads_text and isinstance(model, HFModelConfig) and model.pretrained and has_tokenizer(model.pretrained):
        return model.pretrained
    return None


def check_data(config: TrainConfig, arguments: Mapping[str, Any]) -> int | None:
    """Before any rank starts: the data exists and what reads it is installed. Returns the vocabulary its tokens need
    (256 for bytes, the tokenizer's size), None where that is not known (token ids, your DataModule)."""
    data = config.data
    check_target("data", data._target_, L.LightningDataModule, arguments)
    if data._target_ is not None:
        return None
    model = config.model
    takes = BatchFormat.dicts if isinstance(model, HFModelConfig) else BatchFormat.pairs
    yours = isinstance(model, ModelConfig) and model._target_ is not None
    if not yours and data.batch_format not in (None, takes):
        raise ConfigError(f"data.batch_format={data.batch_format}: model={model.name} takes {takes}; leave it null")
    if data.text_file is not None and not Path(data.text_file).is_file():
        raise ConfigError(f"data.text_file={data.text_file}: no such file; give a local text file")
    if data.dataset_dir is not None:
        if not Path(data.dataset_dir).is_dir():
            raise ConfigError(
                f"data.dataset_dir={data.dataset_dir}: no such directory; give one Dataset.save_to_disk wrote"
            )
        try:
            dataset = saved_dataset(data.dataset_dir)
        except ImportError as error:
            raise ConfigError(str(error)) from None
        if not isinstance(dataset[0][chosen_column(dataset, data.column)], str):
            return None  # token ids
    tokenizer = tokenizer_dir(config)
    if tokenizer is None:
        return BYTES
    try:
        return len(load_tokenizer(tokenizer))
    except (OSError, ValueError) as error:
        raise ConfigError(f"model.pretrained={tokenizer}: its tokenizer does not load: {error}") from None


def build_data(config: TrainConfig, arguments: Mapping[str, Any]) -> L.LightningDataModule:
    """This rank's DataModule (every rank reads the same data; Lightning's DistributedSampler splits it)."""
    data = config.data
    if data._target_ is not None:
        return build_target(data._target_, arguments)
    tokenizer = tokenizer_dir(config)
    source: TokenSource = StdlibBytes(data.corpus_bytes)
    if data.text_file is not None:
        source = TextFile(data.text_file, tokenizer)
    elif data.dataset_dir is not None:
        source = SavedDataset(data.dataset_dir, data.column, tokenizer)
    batch_format = data.batch_format or (BatchFormat.dicts if isinstance(config.model, HFModelConfig) else None)
    return TokenDataModule(
        source,
        seq_len=config.model.seq_len,
        global_batch=data.global_batch,
        val_fraction=data.val_fraction,
        num_workers=data.num_workers,
        seed=config.seed,
        dict_batches=batch_format is BatchFormat.dicts,
    )
