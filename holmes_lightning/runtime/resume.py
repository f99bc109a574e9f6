"""Mid-epoch resume with the uninterrupted run's data order, and the checkpoint a run resumes from.

Lightning restores its loop counters from a checkpoint but iterates the epoch's DataLoader from its first batch again
(only loaders with their own `state_dict` continue). `resumable` gives the training DataLoader a sampler that skips
the batches the loop already counts as done in this epoch: indices only, no data is loaded for them.
`checkpoint_to_load` names the checkpoint while the strategy is set up, before Lightning restores it.
"""

from __future__ import annotations

import inspect
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


def checkpoint_to_load(trainer: pl.Trainer) -> str | None:
    """The checkpoint the running `fit` (`validate`, `test`, `predict`) restores once the strategy is set up; None:
    none. Call it from the strategy's `setup`.

    Lightning restores a ModelParallelStrategy's checkpoint after `setup` (`restore_checkpoint_after_setup`) and sets
    `trainer.ckpt_path` only then. The path it chose (`ckpt_path=`, or `trainer.ckpt_path` set before the call, with
    "last" and "best" resolved) is already the `ckpt_path` argument of `Trainer._run`, the call that runs `setup`.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "_run" and frame.f_locals.get("self") is trainer:
                path = frame.f_locals.get("ckpt_path")
                return None if path is None else str(path)
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame kept in a local would keep every caller's locals alive
