"""Language-model data as windows of one token stream; by default bytes of text every machine has: the Python
standard library's own source files."""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

THIRD_PARTY_DIRS = {"site-packages", "dist-packages"}


def stdlib_sources() -> list[Path]:
    """The standard library's .py files (installed packages left out, not even walked), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in THIRD_PARTY_DIRS]
        files.extend(Path(folder, name) for name in names if name.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(num_bytes: int) -> bytes:
    """The first `num_bytes` of the standard library's sources, concatenated in sorted file order."""
    chunks: list[bytes] = []
    size = 0
    for path in stdlib_sources():
        chunks.append(path.read_bytes())
        size += len(chunks[-1])
        if size >= num_bytes:
            return b"".join(chunks)[:num_bytes]
    raise ValueError(f"data.corpus_bytes={num_bytes}: the standard library has only {size} bytes; lower it")


class TokenSource(Protocol):
    """Where a token stream comes from: `tokens()` reads it whole (1-D integers, uint8 for bytes); `mismatch` says
    what to fix when a rank reads other tokens than rank 0."""

    mismatch: str

    def tokens(self) -> torch.Tensor: ...


def byte_tokens(data: bytes) -> torch.Tensor:
    """Bytes as a token stream (a vocabulary of 256)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass(frozen=True)
class StdlibBytes:
    """The first `corpus_bytes` of the standard library's sources, as bytes."""

    corpus_bytes: int
    mismatch: ClassVar[str] = (
        "its standard-library corpus differs from rank 0's (another Python version?); run every node with the same "
        "Python"
    )

    def tokens(self) -> torch.Tensor:
        return byte_tokens(stdlib_corpus(self.corpus_bytes))


class TokenWindows(Dataset):
    """Non-overlapping windows of `seq_len` tokens: item i is (inputs, targets) with targets shifted by one token,
    or with `dicts` HF's batch dict (`input_ids` and `labels` the same tokens, HF's loss shifts them;
    `attention_mask`)."""

    def __init__(self, data: torch.Tensor, seq_len: int, dicts: bool = False) -> None:
        self.data = data
        self.seq_len = seq_len
        self.dicts = dicts

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]:
        start = index * self.seq_len
        window = self.data[start : start + self.seq_len + 1].long()
        if self.dicts:
            ids = window[:-1]
            return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
        return window[:-1], window[1:]


class TokenDataModule(L.LightningDataModule):
    """Train/val split of one token stream into windows of `seq_len`; `global_batch` sequences per step over all
    replicas, as (inputs, targets) or, with `dict_batches`, HF's dicts."""

    def __init__(
        self,
        source: TokenSource,
        seq_len: int,
        global_batch: int,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        seed: int = 1234,
        dict_batches: bool = False,
    ) -> None:
        super().__init__()
        self.source = source
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.seed = seed
        self.dict_batches = dict_batches
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    def setup(self, stage: str) -> None:
        data = self.source.tokens()
        self._check_same_tokens_everywhere(data)
        split = int(len(data) * (1 - self.val_fraction))
        self.train_set = TokenWindows(data[:split], self.seq_len, self.dict_batches)
        self.val_set = TokenWindows(data[split:], self.seq_len, self.dict_batches)

    def _check_same_tokens_everywhere(self, data: torch.Tensor) -> None:
        """Nodes that read different data (another file, another Python's corpus) would train on a mix: refuse."""
        if self.trainer is None or self.trainer.world_size == 1:
            return
        digest = hashlib.sha256(data.numpy().tobytes()).hexdigest()
        if self.trainer.strategy.broadcast(digest, src=0) != digest:
            raise RuntimeError(f"rank {self.trainer.global_rank}: {self.source.mismatch}")

    @property
    def replicas(self) -> int:
        """How many data-parallel replicas share the global batch (pipeline stages of one replica see the same data)."""
        if self.trainer is None:
            return 1
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        return kwargs.get("num_replicas", 1)

    @property
    def per_replica_batch(self) -> int:
        """The strategy's `replica_batch_size` where it has one (HolmesStrategy: under DiLoCo the replicas of every
        site share the data, each site's its own batch), else the global batch over the replicas."""
        asked = getattr(self.trainer.strategy, "replica_batch_size", None) if self.trainer is not None else None
        if asked is not None:
            return asked
        if self.global_batch % self.replicas:
            raise ValueError(
                f"data.global_batch={self.global_batch} does not split over {self.replicas} data-parallel replicas; "
                f"use a multiple of {self.replicas}"
            )
        return self.global_batch // self.replicas

    def train_dataloader(self) -> DataLoader:
        if len(self.train_set) < self.per_replica_batch:
            raise ValueError(
                f"the training split holds {len(self.train_set)} sequences of {self.seq_len} tokens, fewer than one "
                f"batch of {self.per_replica_batch}; give more data or lower data.global_batch"
            )
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self.train_set,
            batch_size=self.per_replica_batch,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
            generator=generator,
        )

    def val_dataloader(self) -> DataLoader:
        """Checked here, not in `setup`: the split over replicas is known only once HolmesStrategy has planned."""
        if len(self.val_set) < self.per_replica_batch:
            raise ValueError(
                f"data.val_fraction={self.val_fraction}: the validation split holds {len(self.val_set)} sequences of "
                f"{self.seq_len} tokens, fewer than one batch of {self.per_replica_batch}; raise data.val_fraction or "
                f"give more data"
            )
        return DataLoader(self.val_set, batch_size=self.per_replica_batch, drop_last=True, num_workers=self.num_workers)


class ByteCorpusDataModule(TokenDataModule):
    """Train/val split of a fixed slice of the stdlib corpus (`StdlibBytes`), bytes as tokens."""

    def __init__(
        self,
        seq_len: int,
        global_batch: int,
        corpus_bytes: int = 2_000_000,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        seed: int = 1234,
        dict_batches: bool = False,
    ) -> None:
        source = StdlibBytes(corpus_bytes)
        super().__init__(source, seq_len, global_batch, val_fraction, num_workers, seed, dict_batches)
