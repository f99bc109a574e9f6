"""Token streams from your own text: a local text file, or a `datasets` dataset saved on disk (a column of token ids
or of text). Text becomes tokens by an HF tokenizer (a local directory) or, without one, as its UTF-8 bytes.

`transformers` (the `hf` extra) is needed only for a tokenizer, `datasets` (the `datasets` extra) only for datasets.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from holmes_lightning.recipes.data import byte_tokens

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
TEXT_COLUMNS = ("input_ids", "text")  # looked for in this order when no column is named


def has_tokenizer(directory: str | Path) -> bool:
    """Whether a local HF directory holds a tokenizer."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(directory: str | Path) -> Any:
    """The HF tokenizer saved in `directory` (`AutoTokenizer`, local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def encode(texts: Sequence[str], tokenizer: str | None) -> torch.Tensor:
    """The texts' tokens, one after the other: the ids of the tokenizer in directory `tokenizer`, else UTF-8 bytes."""
    if tokenizer is None:
        return byte_tokens("".join(texts).encode())
    ids = load_tokenizer(tokenizer)(list(texts), verbose=False)["input_ids"]  # verbose: no warning on long texts
    return torch.tensor(list(itertools.chain.from_iterable(ids)), dtype=torch.long)


@dataclass(frozen=True)
class TextFile:
    """A local text file: its bytes, or its text tokenised by the tokenizer in directory `tokenizer`."""

    path: str
    tokenizer: str | None = None
    mismatch: ClassVar[str] = "its data.text_file differs from rank 0's; give every node the same file"

    def tokens(self) -> torch.Tensor:
        if self.tokenizer is None:
            return byte_tokens(Path(self.path).read_bytes())
        return encode([Path(self.path).read_text()], self.tokenizer)


def saved_dataset(directory: str | Path) -> Any:
    """`datasets.load_from_disk(directory)`: a Dataset, or a DatasetDict's `train` split."""
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"data.dataset_dir={directory}: reading a saved dataset needs the `datasets` package, an optional extra: "
            f"pip install 'holmes-lightning[datasets]' (or pip install datasets)"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(directory))
    except FileNotFoundError as error:
        raise ValueError(f"data.dataset_dir={directory}: {error}; save one with Dataset.save_to_disk") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"data.dataset_dir={directory}: its splits are {sorted(loaded)}, none is 'train'")
        return loaded["train"]
    return loaded


def chosen_column(dataset: Any, column: str | None) -> str:
    """`column`, checked to be one of token ids or text; without one, `input_ids` or else `text`."""
    if column is None:
        column = next((name for name in TEXT_COLUMNS if name in dataset.column_names), None)
        if column is None:
            raise ValueError(
                f"data.column=null: the dataset has neither of {list(TEXT_COLUMNS)} (its columns: "
                f"{dataset.column_names}); name one with data.column"
            )
    elif column not in dataset.column_names:
        raise ValueError(f"data.column={column}: the dataset's columns are {dataset.column_names}")
    if len(dataset) == 0:
        raise ValueError(f"data.column={column}: the dataset has no rows")
    first = dataset[0][column]
    if not isinstance(first, str) and not (isinstance(first, list) and all(isinstance(t, int) for t in first)):
        raise ValueError(
            f"data.column={column}: holds {type(first).__name__} values; it must hold text or lists of token ids"
        )
    return column


@dataclass(frozen=True)
class SavedDataset:
    """A `datasets` dataset saved on disk: its rows' token ids, or their text tokenised as `encode` does, one row
    after the other."""

    directory: str
    column: str | None = None
    tokenizer: str | None = None
    mismatch: ClassVar[str] = "its data.dataset_dir differs from rank 0's; give every node the same dataset"

    def tokens(self) -> torch.Tensor:
        dataset = saved_dataset(self.directory)
        rows = dataset[chosen_column(dataset, self.column)]
        if isinstance(rows[0], str):
            return encode(rows, self.tokenizer)
        return torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.long)
