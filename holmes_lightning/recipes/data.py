"""Byte-level language-model data from text every machine has: the Python standard library's own source files."""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

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


class ByteWindows(Dataset):
    """Non-overlapping windows of `seq_len` bytes; item i is (inputs, targets) with targets shifted by one byte."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = self.data[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]


class ByteCorpusDataModule(L.LightningDataModule):
    """Train/val split of a fixed slice of the stdlib corpus; `global_batch` sequences per step over all replicas."""

    def __init__(
        self,
        seq_len: int,
        global_batch: int,
        corpus_bytes: int = 2_000_000,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.corpus_bytes = corpus_bytes
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.seed = seed
        self.train_set: ByteWindows | None = None
        self.val_set: ByteWindows | None = None

    def setup(self, stage: str) -> None:
        corpus = stdlib_corpus(self.corpus_bytes)
        self._check_same_corpus_everywhere(corpus)
        data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        split = int(len(data) * (1 - self.val_fraction))
        self.train_set = ByteWindows(data[:split], self.seq_len)
        self.val_set = ByteWindows(data[split:], self.seq_len)

    def _check_same_corpus_everywhere(self, corpus: bytes) -> None:
        """Nodes with different Python versions would read different text: refuse rather than train on a mix."""
        if self.trainer is None or self.trainer.world_size == 1:
            return
        digest = hashlib.sha256(corpus).hexdigest()
        if self.trainer.strategy.broadcast(digest, src=0) != digest:
            raise RuntimeError(
                f"rank {self.trainer.global_rank}: its standard-library corpus differs from rank 0's (another Python "
                f"version?); run every node with the same Python"
            )

    @property
    def replicas(self) -> int:
        """How many data-parallel replicas share the global batch (pipeline stages of one replica see the same data)."""
        if self.trainer is None:
            return 1
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        return kwargs.get("num_replicas", 1)

    @property
    def per_replica_batch(self) -> int:
        if self.global_batch % self.replicas:
            raise ValueError(
                f"data.global_batch={self.global_batch} does not split over {self.replicas} data-parallel replicas; "
                f"use a multiple of {self.replicas}"
            )
        return self.global_batch // self.replicas

    def train_dataloader(self) -> DataLoader:
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
                f"{self.seq_len} bytes, fewer than one batch of {self.per_replica_batch}; raise data.val_fraction or "
                f"data.corpus_bytes"
            )
        return DataLoader(self.val_set, batch_size=self.per_replica_batch, drop_last=True, num_workers=self.num_workers)
