"""Mid-epoch resume with the uninterrupted run's data order, also on another plan, and the checkpoint a run resumes
from.

Lightning restores its loop counters from a checkpoint but iterates the epoch's DataLoader from its first batch again
(only loaders with their own `state_dict` continue). `resumable` gives the training DataLoader a sampler that skips
what the job already read in this epoch: indices only, no data is loaded for them. DistributedSampler deals the
epoch's order to the DP replicas in turn (replica d of dp gets order[d::dp]), so a job that read the first n samples
of the order continues on any dp with each replica skipping n // dp of its share. With a fixed global batch
(`HolmesStrategy(global_batch=...)`) n is a whole number of this run's batches: the rest of the epoch is the
uninterrupted run's on the new plan. When the DataLoader fixes each replica's batch, the global batch changes with
dp: the last n % dp samples read (fewer than dp) are read again, as every replica must run as many batches, and the
loop's batch count moves to this run's batches so that the epoch ends with its data.
`checkpoint_to_load` names the checkpoint while the strategy is set up, before Lightning restores it.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator, Mapping

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.loops.progress import _BatchProgress
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler


class ResumableSampler(Sampler[int]):
    """One DP replica's `sampler`, started after its share of what the whole job read in this epoch.

    `replicas` (the sampler's `num_replicas`, else 1) each read `batch_size` samples per batch (the last one of the
    epoch may be short, or dropped: `drop_last`), and `progress` (the epoch loop's) counts the batches. `state_dict`
    and `load_state_dict` (Lightning saves and restores them with its loops: `resumable` gives them to the DataLoader)
    carry the samples read and the global batch over to a resume on another plan.
    """

    def __init__(self, sampler: Sampler[int], *, batch_size: int, drop_last: bool, progress: _BatchProgress) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.progress = progress
        self.replicas: int = getattr(sampler, "num_replicas", 1)
        self.offset = 0  # this epoch's samples read beyond `global_batch` per counted batch (after a resume)
        self._resumed_offset = 0  # the offset of the epoch a resume continues, for that epoch's iteration

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.replicas

    def samples_read(self) -> int:
        """Samples of this epoch's order the job has read before the loop's next batch."""
        return self.progress.current.ready * self.global_batch + self.offset

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)  # the whole epoch: Lightning counts the skipped batches as fetched already

    def __iter__(self) -> Iterator[int]:
        self.offset, self._resumed_offset = self._resumed_offset, 0
        yield from itertools.islice(self.sampler, self.samples_read() // self.replicas, None)

    def state_dict(self) -> dict[str, int]:
        return {"samples_read": self.samples_read(), "global_batch": self.global_batch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue after `state`'s samples, counting the batches before them in this run's (Lightning calls it
        after restoring its loops, before it iterates)."""
        read, saved_batch = state["samples_read"], state["global_batch"]
        if saved_batch != self.global_batch:
            rank_zero_warn(
                f"holmes: the global batch changed from {saved_batch} to {self.global_batch} samples per step "
                f"({self.replicas} DP replicas x batch_size {self.batch_size}): the DataLoader fixes each replica's "
                f"batch. HolmesStrategy(global_batch={saved_batch}) (train.py: data.global_batch={saved_batch}) fixes "
                f"the global batch on every plan instead (dp then divides it). The epoch continues after the {read} "
                f"samples read"
            )
        if not self.progress.current.ready:
            return
        batches = self._batches(len(self.sampler))
        if self.progress.is_last_batch:  # saved at the epoch's end: Lightning starts the next epoch
            counted = batches
        else:
            skip = read // self.replicas
            counted = batches - self._batches(max(len(self.sampler) - skip, 0))
            self._resumed_offset = skip * self.replicas - counted * self.global_batch
        self.progress.current.increment_by(counted - self.progress.current.ready)

    def _batches(self, samples: int) -> int:
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)


def resumable(dataloader: object, trainer: pl.Trainer) -> object:
    """The training DataLoader with a `ResumableSampler`, whose state Lightning keeps with its loops; other iterables,
    iterable datasets and loaders that keep their own state as they are."""
    if (
        not isinstance(dataloader, DataLoader)
        or isinstance(dataloader, _Stateful)
        or isinstance(dataloader.dataset, IterableDataset)
        or type(dataloader.batch_sampler) is not BatchSampler
        or isinstance(dataloader.sampler, ResumableSampler)
    ):
        return dataloader
    batches, progress = dataloader.batch_sampler, trainer.fit_loop.epoch_loop.batch_progress
    sampler = ResumableSampler(
        dataloader.sampler, batch_size=batches.batch_size, drop_last=batches.drop_last, progress=progress
    )
    loader = _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)
    loader.state_dict, loader.load_state_dict = sampler.state_dict, sampler.load_state_dict  # Lightning's `_Stateful`
    return loader


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
