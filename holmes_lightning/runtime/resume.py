"""Mid-epoch resume with the uninterrupted run's data order.

Lightning restores its loop counters from a checkpoint but iterates the epoch's DataLoader from its first batch again
(only loaders with their own `state_dict` continue). `resumable` gives the training DataLoader a sampler that skips
the batches the loop already counts as done in this epoch: indices only, no data is loaded for them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler


class ResumableSampler(Sampler[int]):
    """`sampler`, started after `batches_done()` batches of `batch_size` (read when each epoch's iteration starts)."""

    def __init__(self, sampler: Sampler[int], batch_size: int, batches_done: Callable[[], int]) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.batches_done = batches_done

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)  # the whole epoch: Lightning counts the skipped batches as fetched already

    def __iter__(self) -> Iterator[int]:
        yield from itertools.islice(self.sampler, self.batches_done() * self.batch_size, None)


def resumable(dataloader: object, trainer: pl.Trainer) -> object:
    """The training DataLoader with a `ResumableSampler`; other iterables (and iterable datasets) as they are."""
    if (
        not isinstance(dataloader, DataLoader)
        or isinstance(dataloader.dataset, IterableDataset)
        or type(dataloader.batch_sampler) is not BatchSampler
        or isinstance(dataloader.sampler, ResumableSampler)
    ):
        return dataloader
    progress = trainer.fit_loop.epoch_loop.batch_progress
    sampler = ResumableSampler(dataloader.sampler, dataloader.batch_size, lambda: progress.current.ready)
    return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)
