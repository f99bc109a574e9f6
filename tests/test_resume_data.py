"""The data position of a mid-epoch resume on another plan: `ResumableSampler` over real DistributedSamplers.

A run at dp_old reads k batches of an epoch and saves; the resume at dp_new restores Lightning's batch progress and
the sampler's state (as Lightning keeps it with its loops) and reads the rest of the epoch. DistributedSampler deals
one order to the replicas in turn (replica d of dp holds order[d::dp], the order padded with its first samples to a
multiple of dp, or with drop_last cut to one), so the first n samples of the order are the same on any dp.

- Fixed global batch G (`HolmesStrategy(global_batch=G)`; dp_old and dp_new divide G): the job read order[:kG], each
  replica skips kG / dp_new, and the resumed batches are exactly those an uninterrupted run at dp_new reads from batch k
  on. Over the epoch every sample is read once, apart from what DistributedSampler repeats (padding) or cuts
  (drop_last) on dp_new and the DataLoader's drop_last drops, as in an uninterrupted run there.
- Fixed per-replica batch b (no `global_batch`): the global batch goes from b x dp_old to b x dp_new. The job read
  n = k x b x dp_old samples; each replica skips n // dp_new of its share, so the last n % dp_new of them (fewer than
  dp_new) are read twice (the replicas must run as many batches) and none is skipped. Lightning's batch count moves to
  this run's batches, so the epoch ends with its data and the next epoch is whole.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.progress import _BatchProgress
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from holmes_lightning.runtime.resume import ResumableSampler, resumable

SEED, EPOCH = 3, 2


def replica_sampler(
    size: int, dp: int, rank: int, *, shuffle: bool, cut: bool, epoch: int = EPOCH
) -> DistributedSampler:
    """What Lightning gives DP replica `rank` of `dp` (`cut`: DistributedSampler's drop_last) in `epoch`."""
    sampler = DistributedSampler(range(size), num_replicas=dp, rank=rank, shuffle=shuffle, seed=SEED, drop_last=cut)
    sampler.set_epoch(epoch)
    return sampler


def epoch_order(size: int, dp: int, *, shuffle: bool, cut: bool, epoch: int = EPOCH) -> list[int]:
    """The epoch's order as DistributedSampler deals it to `dp` replicas: position i goes to replica i % dp."""
    shares = [list(replica_sampler(size, dp, d, shuffle=shuffle, cut=cut, epoch=epoch)) for d in range(dp)]
    return [index for row in zip(*shares, strict=True) for index in row]


def read(
    size: int, dp: int, batch: int, *, shuffle: bool, cut: bool, drop_last: bool, saved: dict[str, Any] | None = None
) -> tuple[list[list[list[int]]], list[int], dict[str, int]]:
    """Each replica's batches of the epoch at `dp`, from where `saved` (progress and sampler state) left it; also each
    replica's batch count after the restore and replica 0's sampler state before reading."""
    batches, counted = [], []
    for rank in range(dp):
        progress = _BatchProgress()
        inner = replica_sampler(size, dp, rank, shuffle=shuffle, cut=cut)
        sampler = ResumableSampler(inner, batch_size=batch, drop_last=drop_last, progress=progress)
        if saved is not None:
            progress.load_state_dict(saved["progress"])
            sampler.load_state_dict(saved["sampler"])
        counted.append(progress.current.ready)
        batches.append([list(b) for b in BatchSampler(sampler, batch, drop_last)])
    return batches, counted, sampler.state_dict()


def save_after(k: int, size: int, dp: int, batch: int, **flags: bool) -> tuple[list[int], dict[str, Any]]:
    """What a run at `dp` read in its first `k` batches of the epoch, and the state it saved then."""
    batches, _, _ = read(size, dp, batch, **flags)
    progress = _BatchProgress()
    progress.increment_by(k, is_last_batch=k == len(batches[0]))
    sampler = ResumableSampler(
        replica_sampler(size, dp, 0, shuffle=flags["shuffle"], cut=flags["cut"]),
        batch_size=batch,
        drop_last=flags["drop_last"],
        progress=progress,
    )
    return [i for replica in batches for b in replica[:k] for i in b], {
        "progress": progress.state_dict(),
        "sampler": sampler.state_dict(),
    }


def flat(batches: list[list[list[int]]]) -> list[int]:
    return [i for replica in batches for b in replica for i in b]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_fixed_global_batch_continues_on_any_dp_as_an_uninterrupted_run_there(data: st.DataObject) -> None:
    dp_old, dp_new = data.draw(st.integers(1, 6), "dp_old"), data.draw(st.integers(1, 6), "dp_new")
    global_batch = math.lcm(dp_old, dp_new) * data.draw(st.integers(1, 3), "multiple")
    size = data.draw(st.integers(global_batch, 150), "size")
    flags = {name: data.draw(st.booleans(), name) for name in ("shuffle", "cut", "drop_last")}
    old_batches = len(read(size, dp_old, global_batch // dp_old, **flags)[0][0])
    k = data.draw(st.integers(0, old_batches - 1), "k")

    before, saved = save_after(k, size, dp_old, global_batch // dp_old, **flags)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the global batch stays: nothing to say
        after, counted, _ = read(size, dp_new, global_batch // dp_new, saved=saved, **flags)
    uninterrupted, _, _ = read(size, dp_new, global_batch // dp_new, **flags)

    assert counted == [k] * dp_new
    assert after == [replica[k:] for replica in uninterrupted]
    assert Counter(before + flat(after)) == Counter(flat(uninterrupted))
    if not flags["cut"] and not flags["drop_last"]:  # every sample once, and DistributedSampler's padding again
        order = epoch_order(size, dp_new, shuffle=flags["shuffle"], cut=False)
        assert Counter(before + flat(after)) == Counter(range(size)) + Counter(order[size:])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_fixed_replica_batch_continues_after_the_samples_read(data: st.DataObject) -> None:
    dp_old, dp_new = data.draw(st.integers(1, 6), "dp_old"), data.draw(st.integers(1, 6), "dp_new")
    batch = data.draw(st.integers(1, 5), "batch")
    size = data.draw(st.integers(batch * max(dp_old, dp_new), 150), "size")
    flags = {"shuffle": data.draw(st.booleans(), "shuffle"), "cut": False, "drop_last": False}  # Lightning's
    old_batches = len(read(size, dp_old, batch, **flags)[0][0])
    k = data.draw(st.integers(0, old_batches - 1), "k")

    before, saved = save_after(k, size, dp_old, batch, **flags)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        after, counted, state = read(size, dp_new, batch, saved=saved, **flags)
    samples = k * batch * dp_old
    order = epoch_order(size, dp_new, shuffle=flags["shuffle"], cut=False)
    again = order[samples // dp_new * dp_new : samples]

    assert saved["sampler"] == {"samples_read": samples, "global_batch": batch * dp_old}
    assert len(again) < dp_new
    assert len({len(replica) for replica in after}) == 1  # every replica runs as many batches
    epoch_batches = len(BatchSampler(range(len(order) // dp_new), batch, False))
    assert counted[0] + len(after[0]) == epoch_batches  # Lightning's count ends the epoch with its data
    assert state["samples_read"] == samples // dp_new * dp_new  # a later save counts from where this run began
    assert Counter(before + flat(after)) == Counter(range(size)) + Counter(order[size:]) + Counter(again)
    assert any("global batch changed" in str(w.message) for w in caught) == (dp_new != dp_old)


def test_a_save_at_the_epochs_end_resumes_at_the_next_epoch_on_another_dp() -> None:
    flags = {"shuffle": True, "cut": False, "drop_last": False}
    _, saved = save_after(5, 20, 2, 2, **flags)  # the whole epoch: 10 samples per replica in 5 batches of 2
    after, counted, _ = read(20, 4, 2, saved=saved, **flags)
    assert counted == [3] * 4 and after == [[]] * 4  # Lightning's count says the epoch is over: it starts the next


class ResumingStrategy(SingleDeviceStrategy):
    """One process on the CPU that resumes its training data as HolmesStrategy does (`resumable`)."""

    def process_dataloader(self, dataloader: object) -> object:
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        return resumable(dataloader, trainer) if trainer.training else dataloader


class Reader(L.LightningModule):
    """Keeps the dataset indices of every batch it trains on, by epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.read: dict[int, list[int]] = {}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.read.setdefault(self.current_epoch, []).extend(batch.tolist())
        return (self.weight * batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit_replica(size: int, dp: int, rank: int, directory: Path, *, steps: int = -1, ckpt: Path | None = None) -> dict:
    """DP replica `rank` of `dp` in its own Trainer, batches of 2 (no collectives: each replica's loop runs alone):
    until `steps`, saving a checkpoint then, or from `ckpt` to the end of epoch 1. The indices it read, by epoch."""
    module = Reader()
    sampler = DistributedSampler(range(size), num_replicas=dp, rank=rank, shuffle=True, seed=SEED)
    saving = [ModelCheckpoint(dirpath=directory, every_n_train_steps=steps)] if ckpt is None else []
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=ResumingStrategy(torch.device("cpu")),
        max_steps=steps,
        max_epochs=2,
        callbacks=saving,
        enable_checkpointing=bool(saving),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(range(size), batch_size=2, sampler=sampler), ckpt_path=ckpt)
    return module.read


def test_lightning_resumes_the_epoch_on_more_replicas_after_the_samples_read(tmp_path: Path) -> None:
    """1 replica reads 5 batches of 2 and saves; 4 replicas resume (global batch 2 -> 8), in an epoch of 4 batches
    there. Lightning alone would count the epoch as over (5 >= 4) and start it again; it continues at batch 1."""
    size = 30
    before = fit_replica(size, 1, 0, tmp_path, steps=5)
    (checkpoint,) = tmp_path.glob("*.ckpt")
    with pytest.warns(UserWarning, match=r"global batch changed from 2 to 8 .* data\.global_batch"):
        after = [fit_replica(size, 4, rank, tmp_path, ckpt=checkpoint) for rank in range(4)]

    order = epoch_order(size, 4, shuffle=True, cut=False, epoch=0)  # padded to 32 with order[:2]
    assert before[0] == order[:10]
    again = order[8:10]  # 10 samples read: each replica skips 10 // 4 of its share, so order[8:10] come again
    assert Counter(before[0] + [i for run in after for i in run[0]]) == Counter(order) + Counter(again)
    assert [len(run[0]) for run in after] == [6] * 4  # the rest of the epoch: 8 each less the 2 skipped
    next_epoch = [list(replica_sampler(size, 4, rank, shuffle=True, cut=False, epoch=1)) for rank in range(4)]
    assert [run[1] for run in after] == next_epoch  # whole
