"""HolmesStrategy in Lightning: argument and contract errors, transports, checkpoint resume, pp=1 without the contract.

The multi-process cases share one 4-rank launch on two_cluster_mixed, with every group bound to 127.0.0.1 through
the address-bound gloo backend (as the lab binds them to each node's addresses).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from distributed import CLASSES, FEATURES, WIDTHS, LossRecorder, TinyMLP, run_ranks, tiny_dataset, tiny_loader
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from holmes_lightning import HolmesStrategy, init_layers
from holmes_lightning.cli.validate import collective_backend
from holmes_lightning.planner import Plan, PlanError, PlanOptions, Sharding, StagePlan, StepPrediction
from holmes_lightning.runtime.contract import ContractError
from holmes_lightning.runtime.planning import from_rank_zero, step_collectives
from holmes_lightning.runtime.preemption import HolmesCheckpoint
from holmes_lightning.topology import LinkKind, NICKind, Topology

SEED, GLOBAL_BATCH, STEPS_PER_EPOCH = 3, 16, 3
QUICK = {"HOLMES_CALIBRATION_SECONDS": "0.05"}  # calibration: time each layer briefly
ONE_RANK = {"name": "one_rank", "clusters": [{"name": "local", "nodes": 1, "nic": {"kind": "ethernet"}}]}


class PlainMLP(L.LightningModule):
    """An ordinary LightningModule: no pipeline_layers / pipeline_loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.02)


def permuted_plan() -> Plan:
    """RoCE ranks first, each DP group in descending rank order: nothing may assume IB first or sorted ranks."""
    fabric = {"dp_link": LinkKind.RDMA, "send_link": LinkKind.TCP}
    stages = (
        StagePlan(index=0, ranks=(3, 2), chunks=((0, 3),), clusters=("B",), nics=(NICKind.roce,), **fabric),
        StagePlan(index=1, ranks=(1, 0), chunks=((3, 6),), clusters=("A",), nics=(NICKind.infiniband,), **fabric),
    )
    return Plan(
        layout="holmes",
        schedule="1F1B",
        stages=stages,
        microbatches=4,
        microbatch_size=2,
        prediction=StepPrediction(0.0, 0.0, 0.0, 0.0, 0.0),
        num_layers=6,
        pp_links=(LinkKind.TCP, LinkKind.TCP),
    )


def _fit(
    model: L.LightningModule,
    strategy: Any,
    max_steps: int,
    loader: Any,
    ckpt_path: str | None = None,
    saver: ModelCheckpoint | None = None,
    nodes: int = 4,
    val_loader: Any = None,
    callbacks: Sequence[L.Callback] = (),
) -> list[float]:
    """Fit on `nodes` ranks (or one process with strategy="auto"); the loss of every step, then the last val_loss."""
    recorder = LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=1 if strategy == "auto" else nodes,
        strategy=strategy,
        max_steps=max_steps,
        gradient_clip_val=0.3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=saver is not None,
        callbacks=[recorder, *callbacks] if saver is None else [recorder, saver, *callbacks],
    )
    trainer.fit(model, loader, val_loader, ckpt_path=ckpt_path)
    return [*recorder.losses, *([float(trainer.callback_metrics["val_loss"])] if val_loader else [])]


def rank_zero_outlasting_the_timeout(make_s: float, collective_s: float) -> list[int]:
    """Rank side, the default group up: rank 0 takes `make_s` to make what every rank gets (as planning does, alone),
    broadcast on a gloo group whose collectives time out after `collective_s`; twice, so each wait is told apart from
    the one before."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=collective_s))

    def broadcast(made: Any) -> Any:  # as Lightning's strategy.broadcast, on that group
        box = [made]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    def make(nth: int) -> int:
        time.sleep(make_s)
        return 10 * nth + dist.get_rank()

    try:
        return [from_rank_zero(partial(make, nth), broadcast) for nth in (1, 2)]
    finally:
        dist.destroy_process_group(group)


def strategy_cases(checkpoint_dir: str) -> dict[str, Any]:
    """Rank side: train, checkpoint, resume on the same and on another plan, train a plain module with pp=1, then
    wait for rank 0 longer than the collective timeout (`rank_zero_outlasting_the_timeout`)."""
    samples, per_replica = STEPS_PER_EPOCH * GLOBAL_BATCH, GLOBAL_BATCH // 2
    common = {"cluster": "two_cluster_mixed", "global_batch": GLOBAL_BATCH, "microbatches": 4, "timeout": 120}
    L.seed_everything(SEED)
    strategy = HolmesStrategy(plan=permuted_plan(), **common)
    saver = ModelCheckpoint(dirpath=checkpoint_dir, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    uninterrupted = _fit(TinyMLP(), strategy, 2 * STEPS_PER_EPOCH, tiny_loader(samples, per_replica), saver=saver)
    mesh = strategy.plan_mesh
    transports = {
        "dp_backend": torch.distributed.get_backend(mesh.dp_mesh.get_group()),
        "dp": [mesh.dp_transport.link.value, mesh.dp_transport.address],
        "pp": [mesh.pp_transport.link.value, mesh.pp_transport.address],
        "coordinate": [mesh.stage, mesh.dp_index],
    }
    resumed = {}
    for name, strategy in {
        "same_plan": HolmesStrategy(plan=permuted_plan(), **common),
        "other_plan": HolmesStrategy(pp=2, dp=2, partition=[2, 4], **common),
    }.items():
        L.seed_everything(SEED)
        loader, step3 = tiny_loader(samples, per_replica), f"{checkpoint_dir}/step=3.ckpt"
        losses = _fit(TinyMLP(), strategy, 2 * STEPS_PER_EPOCH, loader, step3)
        resumed[name] = {"losses": losses, "chunks": [s.chunks for s in strategy.plan.stages]}
    L.seed_everything(SEED)
    plain = HolmesStrategy(cluster="two_cluster_mixed", timeout=120)
    plain_losses = _fit(PlainMLP(), plain, STEPS_PER_EPOCH, tiny_loader(samples, GLOBAL_BATCH // 4))
    return {
        "uninterrupted": uninterrupted,
        "transports": transports,
        "resumed": resumed,
        "plain": {"losses": plain_losses, "pp": plain.plan.pp, "dp": plain.plan.dp},
        "checkpoints": sorted(p.name for p in Path(checkpoint_dir).iterdir()),
        "step3": sorted(p.name for p in Path(checkpoint_dir, "step=3.ckpt").iterdir()),
        "waited": rank_zero_outlasting_the_timeout(make_s=1.5, collective_s=1.0),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    checkpoint_dir = str(tmp_path_factory.mktemp("checkpoints"))
    return run_ranks(
        "test_strategy:strategy_cases", env={"HOLMES_NODE_ADDRESS": "127.0.0.1"}, checkpoint_dir=checkpoint_dir
    )


@pytest.mark.slow
def test_groups_bind_to_the_node_address_on_their_fabric(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        transports = result["transports"]
        assert transports["dp_backend"] == "holmes_gloo"
        assert transports["dp"] == ["rdma", "127.0.0.1"]  # each stage's DP group sits inside one RDMA cluster
        assert transports["pp"] == ["tcp", "127.0.0.1"]  # stage boundaries cross from RoCE to InfiniBand
        assert tuple(transports["coordinate"]) == permuted_plan().coordinate(rank)


@pytest.mark.slow
def test_checkpoints_are_sharded_and_published_whole(ranks: list[dict[str, Any]]) -> None:
    result = ranks[0]
    assert result["checkpoints"] == ["step=3.ckpt", "step=6.ckpt"]  # no staging directory left behind
    assert {".metadata", "meta.pt", "plan.json"} <= set(result["step3"])
    assert sum(name.endswith(".distcp") for name in result["step3"]) == 4  # one shard file per rank


@pytest.mark.slow
def test_the_ranks_wait_for_rank_zeros_plan_longer_than_the_collective_timeout(ranks: list[dict[str, Any]]) -> None:
    """A plan may take minutes on rank 0 (it reports progress); the other ranks wait for it as long as it takes, not
    as for a hung collective (`timeout`, which a user shortens to catch hangs sooner)."""
    assert [result["waited"] for result in ranks] == [[10, 20]] * 4


@pytest.mark.slow
def test_resume_continues_the_uninterrupted_run(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        after = result["uninterrupted"][STEPS_PER_EPOCH:]
        assert result["resumed"]["same_plan"]["losses"] == pytest.approx(after, rel=1e-6)
        other = result["resumed"]["other_plan"]
        assert other["chunks"] != [list(map(list, s.chunks)) for s in permuted_plan().stages]
        assert other["losses"] == pytest.approx(after, rel=1e-4)  # shards are keyed by name: any plan reads them


@pytest.mark.slow
def test_plain_module_trains_with_fsdp_over_all_ranks(ranks: list[dict[str, Any]]) -> None:
    L.seed_everything(SEED)
    loader = tiny_loader(STEPS_PER_EPOCH * GLOBAL_BATCH, GLOBAL_BATCH, single_process_seed=SEED)
    reference = _fit(PlainMLP(), "auto", STEPS_PER_EPOCH, loader)
    assert all((result["plain"]["pp"], result["plain"]["dp"]) == (1, 4) for result in ranks)
    per_rank = torch.tensor([result["plain"]["losses"] for result in ranks])  # each rank's own quarter of the batch
    assert per_rank.mean(dim=0).tolist() == pytest.approx(reference, rel=1e-4)


def one_rank_pipeline() -> dict[str, Any]:
    """Rank side: Interleaved1F1B with pp=1, i.e. two virtual pipeline stages on one device; then validation."""
    L.seed_everything(SEED)
    strategy = HolmesStrategy(
        cluster=ONE_RANK, schedule="Interleaved1F1B", global_batch=GLOBAL_BATCH, microbatches=4, timeout=60
    )
    loader = tiny_loader(STEPS_PER_EPOCH * GLOBAL_BATCH, GLOBAL_BATCH)
    val_loader = tiny_loader(GLOBAL_BATCH, GLOBAL_BATCH, shuffle=False)
    losses = _fit(TinyMLP(), strategy, STEPS_PER_EPOCH, loader, nodes=1, val_loader=val_loader)
    return {"losses": losses, "chunks": [stage.chunks for stage in strategy.plan.stages]}


@pytest.mark.slow
def test_two_virtual_stages_on_one_device_match_plain_training() -> None:
    (result,) = run_ranks("test_strategy:one_rank_pipeline", cluster=ONE_RANK, timeout_s=180)
    ((first, second),) = result["chunks"]  # one rank, two chunks: the planner's split of the six layers
    assert first[0] == 0 and first[1] == second[0] and second[1] == 6
    L.seed_everything(SEED)
    loader = tiny_loader(STEPS_PER_EPOCH * GLOBAL_BATCH, GLOBAL_BATCH, single_process_seed=SEED)
    val_loader = tiny_loader(GLOBAL_BATCH, GLOBAL_BATCH, shuffle=False)
    reference = _fit(TinyMLP(), "auto", STEPS_PER_EPOCH, loader, val_loader=val_loader)
    assert result["losses"] == pytest.approx(reference, rel=1e-4)  # training steps, then the validation loss


class FusedAdamMLP(TinyMLP):
    """TinyMLP with the recipe GPT's fused AdamW, which Lightning's bf16-mixed plugin refuses to clip for."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, fused=True)


class ClippedNorms(L.Callback):
    """The gradients' 2-norm as each optimizer step sees them (after clipping)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        def record(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            self.norms.append(float(torch.nn.utils.get_total_norm(grads)))

        trainer.optimizers[0].register_step_post_hook(record)


def one_rank_bf16_mixed_clipping() -> list[float]:
    """Rank side: bf16-mixed, a fused AdamW and gradient clipping on two virtual stages; each step's clipped norm."""
    clipped = ClippedNorms()
    strategy = HolmesStrategy(
        cluster=ONE_RANK, schedule="Interleaved1F1B", global_batch=GLOBAL_BATCH, microbatches=4, timeout=60
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=2,
        gradient_clip_val=1e-3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clipped],
    )
    trainer.fit(FusedAdamMLP(), tiny_loader(2 * GLOBAL_BATCH, GLOBAL_BATCH))
    return clipped.norms


@pytest.mark.slow
def test_bf16_mixed_clips_for_a_fused_optimizer() -> None:
    """Lightning's MixedPrecision raises for a fused optimizer and clipping (it would unscale fp16 gradients itself,
    Lightning-AI/pytorch-lightning#21435); bf16 has no scaler, so HolmesStrategy clips as in fp32."""
    (norms,) = run_ranks("test_strategy:one_rank_bf16_mixed_clipping", cluster=ONE_RANK, timeout_s=180)
    assert len(norms) == 2 and all(0 < norm <= 1e-3 * (1 + 1e-3) for norm in norms)


def one_rank_without_a_global_batch() -> dict:
    """Rank side: no global batch given; a DataLoader of a fixed batch size, then one asking the strategy for it."""

    class FixedBatch(TinyMLP):
        def train_dataloader(self) -> Any:
            return tiny_loader(32, 8)

    class AsksForIt(TinyMLP):
        def train_dataloader(self) -> Any:
            return tiny_loader(32, self.trainer.strategy.replica_batch_size)

    strategy = HolmesStrategy(cluster=ONE_RANK, timeout=60)
    _fit(FixedBatch(), strategy, 1, None, nodes=1)
    try:
        _fit(AsksForIt(), HolmesStrategy(cluster=ONE_RANK, timeout=60), 1, None, nodes=1)
        error = None
    except ValueError as refused:
        error = str(refused)
    return {"global_batch": strategy.plan.global_batch, "notes": list(strategy.plan.notes), "error": error}


@pytest.mark.slow
def test_without_a_global_batch_the_dataloader_sets_it_or_is_told_how() -> None:
    (result,) = run_ranks("test_strategy:one_rank_without_a_global_batch", cluster=ONE_RANK, timeout_s=180)
    assert result["global_batch"] == 8
    assert "global batch 8: the DataLoader's batch_size=8 x dp=1" in result["notes"]
    assert result["error"].startswith("HolmesStrategy(global_batch=None)")
    assert "give the DataLoader a batch_size" in result["error"]


class DividedBatchMLP(TinyMLP):
    """TinyMLP reading a DataLoader that divides GLOBAL_BATCH among the replicas `distributed_sampler_kwargs` gives
    (the sample to profile on comes from it too)."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.example_input_array = None

    def train_dataloader(self) -> Any:
        split, data = self.trainer.strategy.distributed_sampler_kwargs, tiny_dataset(STEPS_PER_EPOCH * GLOBAL_BATCH)
        sampler = DistributedSampler(data, shuffle=True, seed=SEED, **split)
        return DataLoader(data, batch_size=GLOBAL_BATCH // split["num_replicas"], sampler=sampler, drop_last=True)


def divided_batch(saved: str, resume: bool) -> dict[str, Any]:
    """Rank side: DividedBatchMLP as pp=2 with no global batch given, 2 steps saved to `saved`, or 1 more resumed."""
    L.seed_everything(SEED)
    strategy = HolmesStrategy(cluster="two_cluster_mixed", pp=2, timeout=60)
    if resume:
        return {
            "losses": _fit(DividedBatchMLP(), strategy, 3, None, ckpt_path=saved),
            "new_plan": bool(strategy.calibration),
        }
    saver = ModelCheckpoint(dirpath=Path(saved).parent, filename=Path(saved).stem, every_n_train_steps=2)
    losses = _fit(DividedBatchMLP(), strategy, 2, None, saver=saver)
    return {"losses": losses, "global_batch": strategy.plan.global_batch, "notes": list(strategy.plan.notes)}


@pytest.mark.slow
def test_a_dataloader_dividing_a_global_batch_among_its_replicas_trains_on_it_and_resumes_on_its_plan(tmp_path):
    """No global batch given: the DataLoader's batch_size is GLOBAL_BATCH // num_replicas, a size that depends on the
    DP degree the planner has yet to choose. The job trains one process's steps on that global batch, and a resume
    from its checkpoint runs the stored plan again (the loader, split as that plan splits it, yields its batch)."""
    saved = str(tmp_path / "divided.ckpt")
    first = run_ranks("test_strategy:divided_batch", saved=saved, resume=False, timeout_s=180, env=QUICK)
    assert first[0]["global_batch"] == GLOBAL_BATCH
    assert any(
        note.startswith(f"global batch {GLOBAL_BATCH}: the DataLoader's batch_size with one replica")
        for note in first[0]["notes"]
    )
    L.seed_everything(SEED)
    loader = tiny_loader(STEPS_PER_EPOCH * GLOBAL_BATCH, GLOBAL_BATCH, single_process_seed=SEED)
    reference = _fit(TinyMLP(), "auto", 2, loader)
    assert all(rank["losses"] == pytest.approx(reference, rel=1e-5) for rank in first)
    again = run_ranks("test_strategy:divided_batch", saved=saved, resume=True, timeout_s=180, env=QUICK)
    assert all(len(rank["losses"]) == 1 and not rank["new_plan"] for rank in again)


SHORT_VALIDATION = 22  # 11 per replica: a batch of 8, then 3, which 2 micro-batches do not split


def short_last_batches(sizes: list[int], steps: list[int]) -> list[list[float]]:
    """Rank side: TinyMLP as pp=2 x dp=2 for `steps` on each training-set size in `sizes`, on DataLoaders that keep
    their short last batch (Lightning splits them among the replicas); each fit's step losses and last val_loss."""
    runs = []
    for size, max_steps in zip(sizes, steps, strict=True):
        L.seed_everything(SEED)
        strategy = HolmesStrategy(cluster="two_cluster_mixed", pp=2, global_batch=GLOBAL_BATCH, timeout=60)
        train = DataLoader(tiny_dataset(size), batch_size=GLOBAL_BATCH // 2, shuffle=True)
        validation = DataLoader(tiny_dataset(SHORT_VALIDATION), batch_size=GLOBAL_BATCH // 2)
        runs.append(_fit(TinyMLP(), strategy, max_steps, train, val_loader=validation))
    return runs


@pytest.mark.slow
def test_an_epochs_short_last_batch_trains_and_evaluates_as_in_one_process() -> None:
    """DataLoaders keep an epoch's last, short batch by default. 36 samples leave 2 per replica, which train in 2
    micro-batches of 1; 34 leave 1, which 1F1B cannot run over 2 stages, so GPipe's schedule trains it. The
    validation set's last 3 per replica evaluate in one micro-batch (GPipe's forward too). Losses and val_loss are
    one process's on the same global batches."""
    sizes, steps = [2 * GLOBAL_BATCH + 4, 2 * GLOBAL_BATCH + 2], [6, 6]  # two epochs of 3 steps each
    ranks = run_ranks("test_strategy:short_last_batches", sizes=sizes, steps=steps, timeout_s=240, env=QUICK)
    references = []
    for size, max_steps in zip(sizes, steps, strict=True):
        L.seed_everything(SEED)
        data = tiny_dataset(size)
        order = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED)
        train = DataLoader(data, batch_size=GLOBAL_BATCH, sampler=order)
        validation = DataLoader(tiny_dataset(SHORT_VALIDATION), batch_size=GLOBAL_BATCH)
        assert len(train) == max_steps // 2
        references.append(_fit(TinyMLP(), "auto", max_steps, train, val_loader=validation))
    for runs in ranks:
        assert runs == [pytest.approx(reference, rel=1e-5) for reference in references]


class TokenMLP(L.LightningModule):
    """Per-token next-token logits from an embedding and an MLP: batches of sequences of any length."""

    def __init__(self) -> None:
        super().__init__()
        hidden = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)]
        self.layers = nn.ModuleList([nn.Embedding(32, 16), *hidden, nn.Linear(16, 32)])

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(outputs.flatten(0, 1), targets.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        outputs = batch[0]
        for layer in self.layers:
            outputs = layer(outputs)
        return self.pipeline_loss(outputs, batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.02)


def padded_sequences(sampler: Any = None) -> DataLoader:
    """Sequences of 3 to 63 tokens, each batch padded to its longest (as HF's padding collators do)."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 64, (6 * GLOBAL_BATCH,), generator=generator).tolist()
    rows = [torch.randint(1, 32, (length,), generator=generator) for length in lengths]

    def pad(batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = nn.utils.rnn.pad_sequence(batch, batch_first=True)
        return tokens, tokens.roll(-1, dims=1)

    return DataLoader(rows, batch_size=GLOBAL_BATCH, shuffle=sampler is None, sampler=sampler, collate_fn=pad)


def padded_sequence_steps() -> list[float]:
    """Rank side: TokenMLP on 4 stages (dp=1) for 6 steps of `padded_sequences`, whose shapes change every batch."""
    L.seed_everything(SEED)
    strategy = HolmesStrategy(cluster="two_cluster_mixed", pp=4, global_batch=GLOBAL_BATCH, timeout=60)
    return _fit(TokenMLP(), strategy, 6, padded_sequences())


@pytest.mark.slow
def test_batches_padded_to_their_longest_sequence_train_as_in_one_process() -> None:
    """Each shape gets its own stage buffers (torch sizes them by the first micro-batch it sees): before, the stages
    kept the first batch's shapes and the job failed at the next one."""
    ranks = run_ranks("test_strategy:padded_sequence_steps", timeout_s=240, env=QUICK)
    L.seed_everything(SEED)
    order = DistributedSampler(range(6 * GLOBAL_BATCH), num_replicas=1, rank=0, shuffle=True, seed=SEED)
    reference = _fit(TokenMLP(), "auto", 6, padded_sequences(order))
    assert all(losses == pytest.approx(reference, rel=1e-5) for losses in ranks)


class FrozenFirstMLP(TinyMLP):
    """TinyMLP with its first layer frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[0].requires_grad_(False)


class FineTunedMLP(FrozenFirstMLP):
    """An optimizer over the trainable parameters only, as one fine-tunes."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW((p for p in self.parameters() if p.requires_grad), lr=self.hparams.lr)


class UnfreezeAfterTheFirstEpoch(L.Callback):
    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.current_epoch == 1:
            module.layers[0].requires_grad_(True)


def fine_tuned(checkpoint_dir: str) -> dict[str, list[float]]:
    """Rank side: the frozen layer alone on stage 0. FineTunedMLP 2 epochs saved after the first, then resumed; and
    FrozenFirstMLP 1 epoch saved, then resumed for the next with its first layer unfrozen."""
    samples, epoch, runs = STEPS_PER_EPOCH * GLOBAL_BATCH, STEPS_PER_EPOCH, {}
    for model, run, saved, steps in (
        (FineTunedMLP, "uninterrupted", None, 2 * epoch),
        (FineTunedMLP, "resumed", f"{checkpoint_dir}/uninterrupted/step={epoch}.ckpt", 2 * epoch),
        (FrozenFirstMLP, "frozen_epoch", None, epoch),
        (FrozenFirstMLP, "unfrozen", f"{checkpoint_dir}/frozen_epoch/step={epoch}.ckpt", 2 * epoch),
    ):
        L.seed_everything(SEED)
        module = model()
        module.layers[0].requires_grad_(run == "unfrozen")
        saver = ModelCheckpoint(f"{checkpoint_dir}/{run}", "{step}", every_n_train_steps=epoch, save_top_k=-1)
        strategy = HolmesStrategy(cluster="two_cluster_mixed", partition=[1, 5], global_batch=GLOBAL_BATCH)
        loader = tiny_loader(samples, GLOBAL_BATCH // 2)
        runs[run] = _fit(module, strategy, steps, loader, saved, None if saved else saver)
    return runs


@pytest.mark.slow
def test_a_stage_of_frozen_layers_trains_and_resumes_as_in_one_process(tmp_path: Path) -> None:
    """The stage holding only the frozen layer builds the module's optimizer too: over the trainable parameters it
    was empty, which torch refuses ("optimizer got an empty parameter list") on that stage's ranks. Unfrozen on a
    resume, the layer has no optimizer state saved: it starts afresh, as one process's unfrozen layer does (the
    checkpoint's load missed the keys)."""
    ranks = run_ranks("test_strategy:fine_tuned", checkpoint_dir=str(tmp_path), timeout_s=240, env=QUICK)
    references = {}
    for model, callbacks in ((FineTunedMLP, []), (FrozenFirstMLP, [UnfreezeAfterTheFirstEpoch()])):
        L.seed_everything(SEED)
        loader = tiny_loader(STEPS_PER_EPOCH * GLOBAL_BATCH, GLOBAL_BATCH, single_process_seed=SEED)
        references[model] = _fit(model(), "auto", 2 * STEPS_PER_EPOCH, loader, callbacks=callbacks)
    fine_tuned_losses, unfrozen_losses = references[FineTunedMLP], references[FrozenFirstMLP]
    for runs in ranks:
        assert runs["uninterrupted"] == pytest.approx(fine_tuned_losses, rel=1e-5)
        assert runs["resumed"] == pytest.approx(fine_tuned_losses[STEPS_PER_EPOCH:], rel=1e-5)
        assert runs["frozen_epoch"] == pytest.approx(unfrozen_losses[:STEPS_PER_EPOCH], rel=1e-5)
        assert runs["unfrozen"] == pytest.approx(unfrozen_losses[STEPS_PER_EPOCH:], rel=1e-5)


class SharedBlockMLP(DividedBatchMLP):
    """One block applied four times, written as `[block] * 4` in a ModuleList (ALBERT shares its layer so); its
    sample comes from the data (on meta, an example input would hold none)."""

    def __init__(self) -> None:
        super().__init__(widths=(FEATURES, 16, CLASSES))
        block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.layers = nn.ModuleList([self.layers[0], *[block] * 4, self.layers[1]])
        init_layers(self)  # no init_layer: each Linear's reset_parameters(), from its layer's seed


def shared_block(partitions: list[list[int]]) -> list[list[float]]:
    """Rank side: SharedBlockMLP built on meta, split by each of `partitions`; the losses of each fit."""
    runs = []
    for partition in partitions:
        L.seed_everything(SEED)
        strategy = HolmesStrategy(cluster="two_cluster_mixed", partition=partition, global_batch=GLOBAL_BATCH)
        with torch.device("meta"):
            model = SharedBlockMLP()
        runs.append(_fit(model, strategy, STEPS_PER_EPOCH, None))
    return runs


@pytest.mark.slow
def test_a_block_shared_by_layers_on_several_stages_trains_as_in_one_process() -> None:
    """Built on meta, each rank fills the layers it keeps, the block with its first holder's values as one process
    does; stages that apply the block keep it (copies whose gradients are summed over them), a stage that does not
    drops every place it is registered: the losses are one process's."""
    partitions = [[3, 3], [1, 2, 2, 1]]  # both stages apply it; stage 3 does not
    ranks = run_ranks("test_strategy:shared_block", partitions=partitions, timeout_s=240, env=QUICK)
    L.seed_everything(SEED)
    loader = tiny_loader(STEPS_PER_EPOCH * GLOBAL_BATCH, GLOBAL_BATCH, single_process_seed=SEED)
    reference = _fit(SharedBlockMLP(), "auto", STEPS_PER_EPOCH, loader)
    for runs in ranks:
        assert runs == [pytest.approx(reference, rel=1e-5)] * len(partitions)


def parameterless_stage() -> str:
    """Rank side: TinyMLP behind a parameterless first layer, which partition=[1, 6] leaves alone on stage 0."""
    model = TinyMLP()
    model.layers.insert(0, nn.Tanh())
    strategy = HolmesStrategy(
        cluster="two_cluster_mixed", pp=2, partition=[1, 6], global_batch=GLOBAL_BATCH, timeout=60
    )
    try:
        _fit(model, strategy, 1, tiny_loader(GLOBAL_BATCH, GLOBAL_BATCH // 2))
    except ValueError as refused:
        return str(refused)
    return "trained"


@pytest.mark.slow
def test_a_stage_without_parameters_is_refused_before_its_optimizer() -> None:
    """Its ranks would build the module's optimizer over no parameters, which torch refuses with no word of why."""
    refused = run_ranks("test_strategy:parameterless_stage", timeout_s=180, env=QUICK)
    assert all(message == refused[0] for message in refused)
    assert refused[0].startswith("the plan's stage 0 (ranks [0, 1]) holds only pipeline layers without parameters")
    assert "(0:Tanh)" in refused[0] and "partition=" in refused[0]


class BatchNormMLP(TinyMLP):
    """TinyMLP normalising its first layer's output over the batch, profiled on one sample of its DataLoader."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[2].append(nn.BatchNorm1d(WIDTHS[3]))  # after the activation: no bias just before it, whose
        # gradient BatchNorm makes ~0 and AdamW then steps by the float noise
        self.example_input_array = None


def batch_norm_stages() -> list[float]:
    """Rank side: BatchNormMLP over pp=4 stages in one micro-batch (each step's batch statistics are one process's)."""
    L.seed_everything(SEED)
    strategy = HolmesStrategy(
        cluster="two_cluster_mixed", pp=4, schedule="GPipe", global_batch=GLOBAL_BATCH, microbatches=1, timeout=60
    )
    validation = DataLoader(tiny_dataset(2 * GLOBAL_BATCH), batch_size=GLOBAL_BATCH)
    loader = tiny_loader(STEPS_PER_EPOCH * GLOBAL_BATCH, GLOBAL_BATCH)
    return _fit(BatchNormMLP(), strategy, STEPS_PER_EPOCH, loader, val_loader=validation)


@pytest.mark.slow
def test_batch_norm_trains_and_keeps_its_running_statistics_as_in_one_process() -> None:
    """Profiling and calibration run the layers on one sample (BatchNorm refused it in training: "Expected more than 1
    value per channel") and must leave the running statistics as they were: the val_loss, which reads them, is one
    process's."""
    ranks = run_ranks("test_strategy:batch_norm_stages", timeout_s=180, env=QUICK)
    L.seed_everything(SEED)
    validation = DataLoader(tiny_dataset(2 * GLOBAL_BATCH), batch_size=GLOBAL_BATCH)
    loader = tiny_loader(STEPS_PER_EPOCH * GLOBAL_BATCH, GLOBAL_BATCH, single_process_seed=SEED)
    reference = _fit(BatchNormMLP(), "auto", STEPS_PER_EPOCH, loader, val_loader=validation)
    for losses in ranks:
        assert losses == pytest.approx(reference, rel=1e-5)


class Float32LossMLP(TinyMLP):
    """TinyMLP whose loss upcasts the logits, as HF's does: under bf16-true a float32 loss on the last stage only."""

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(outputs.float(), targets)


def bf16_true_pipeline() -> dict[str, Any]:
    """Rank side: precision="bf16-true" (bf16 the default dtype) on pp=2 x dp=2, clipped; the losses and norms."""
    clipped, recorder = ClippedNorms(), LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=4,
        strategy=HolmesStrategy(cluster="two_cluster_mixed", pp=2, global_batch=GLOBAL_BATCH, timeout=60),
        precision="bf16-true",
        max_steps=3,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clipped, recorder],
    )
    trainer.fit(Float32LossMLP(), tiny_loader(3 * GLOBAL_BATCH, GLOBAL_BATCH // 2))
    return {"losses": recorder.losses, "norms": clipped.norms}


@pytest.mark.slow
def test_bf16_true_pipelines_agree_on_the_loss_and_the_clipping_norm() -> None:
    """The step's loss and the clipping norm are all-reduced over stages whose tensors' dtypes differ (a float32
    loss on the last stage, bf16 zeros elsewhere): each in float32 on every rank, so the collectives match."""
    ranks = run_ranks("test_strategy:bf16_true_pipeline", timeout_s=180)
    assert all(rank["losses"] == ranks[0]["losses"] for rank in ranks) and len(ranks[0]["losses"]) == 3
    assert all(math.isfinite(loss) for loss in ranks[0]["losses"])
    assert all(0 < norm <= 0.5 * (1 + 1e-2) for rank in ranks for norm in rank["norms"])


class RowsOfRank(torch.utils.data.IterableDataset):
    """A stream of `tiny_dataset`'s rows, each rank taking every n-th: by the global rank, as under DDP, or by the
    DP replica (`distributed_sampler_kwargs`)."""

    def __init__(self, shard: dict[str, int]) -> None:
        self.shard = shard

    def __iter__(self) -> Any:
        rows = tiny_dataset(256)
        yield from (rows[i] for i in range(self.shard["rank"], len(rows), self.shard["num_replicas"]))


def rows_sharded_by(shard_by: str) -> str:
    """Rank side: fit TinyMLP as pp=2 x dp=2 on a stream sharded by `shard_by` ("global rank" or "DP replica")."""

    class Streamed(TinyMLP):
        def train_dataloader(self) -> Any:
            if shard_by == "DP replica":
                shard = self.trainer.strategy.distributed_sampler_kwargs
            else:
                shard = {"num_replicas": dist.get_world_size(), "rank": dist.get_rank()}
            return torch.utils.data.DataLoader(RowsOfRank(shard), batch_size=GLOBAL_BATCH // 2)

    strategy = HolmesStrategy(cluster="two_cluster_mixed", pp=2, global_batch=GLOBAL_BATCH, timeout=60)
    try:
        _fit(Streamed(), strategy, 2, None)
    except ValueError as refused:
        return str(refused)
    return "trained"


@pytest.mark.slow
def test_the_stages_of_a_replica_reading_different_batches_stop_at_the_first_one() -> None:
    """A stream sharded by the global rank, as DDP would: stage 0 of a pipeline reads other rows than the last stage,
    whose targets would then belong to other inputs. Every rank stops at the first batch, saying how to shard; the
    same stream sharded by the DP replica trains."""
    refused = run_ranks("test_strategy:rows_sharded_by", shard_by="global rank", timeout_s=180)
    assert all(message.startswith("the ranks of one pipeline read different training batches") for message in refused)
    assert "distributed_sampler_kwargs" in refused[0] and "not the global rank" in refused[0]
    assert run_ranks("test_strategy:rows_sharded_by", shard_by="DP replica", timeout_s=180) == ["trained"] * 4


def one_rank_compiled_layer_zero_bubble() -> str:
    """Rank side: a user's model with one torch.compile'd pipeline layer under InterleavedZeroBubble; the refusal."""
    model = TinyMLP()
    model.layers[1] = torch.compile(model.layers[1])
    strategy = HolmesStrategy(cluster=ONE_RANK, schedule="InterleavedZeroBubble", global_batch=GLOBAL_BATCH, timeout=60)
    try:
        _fit(model, strategy, 1, tiny_loader(GLOBAL_BATCH, GLOBAL_BATCH), nodes=1)
    except ValueError as refused:
        return str(refused)
    return "trained"


@pytest.mark.slow
def test_a_zero_bubble_schedule_refuses_compiled_layers_with_what_to_use() -> None:
    (message,) = run_ranks("test_strategy:one_rank_compiled_layer_zero_bubble", cluster=ONE_RANK, timeout_s=180)
    assert "torch.compile'd modules (pipeline layers [1])" in message
    assert "use schedule=Interleaved1F1B or 1F1B" in message


def test_pipeline_without_the_contract_says_what_to_add() -> None:
    with pytest.raises(ContractError, match=r"PlainMLP to define pipeline_layers and pipeline_loss: add `def"):
        HolmesStrategy(cluster="two_cluster_mixed", pp=2).connect(PlainMLP())


def test_batches_are_inputs_and_targets_or_dicts_of_input_ids_and_labels() -> None:
    from holmes_lightning.runtime.contract import split_batch

    with pytest.raises(ContractError, match="batches of the form \\(inputs, targets\\)"):
        split_batch([torch.zeros(2)])
    with pytest.raises(ContractError, match="a dict batch needs 'labels' for the loss; got keys \\['inputs'\\]"):
        split_batch({"inputs": torch.zeros(2)})
    with pytest.raises(ContractError, match="drop \\['token_type_ids'\\] in the DataLoader's collate_fn"):
        split_batch({"input_ids": torch.zeros(2, 3), "labels": torch.zeros(2, 3), "token_type_ids": torch.zeros(2)})
    ids = torch.arange(6).view(2, 3)
    inputs, labels = split_batch({"input_ids": ids, "labels": ids})
    assert torch.equal(inputs[1], torch.ones_like(ids)) and torch.equal(inputs[2], torch.tensor([[0, 1, 2]] * 2))
    features, mask, targets = torch.zeros(2, 4), torch.ones(2, 4), torch.zeros(2)
    inputs, labels = split_batch([[features, mask], targets])  # several inputs, as the default collate lists them
    assert len(inputs) == 2 and inputs[0] is features and inputs[1] is mask and labels is targets
    with pytest.raises(ContractError, match="inputs may be several"):
        split_batch(((features, None), targets))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"schedule": "ZBV"}, r"schedule='ZBV'\): use one of GPipe, 1F1B, Interleaved1F1B"),
        ({"sharding": "zero3"}, r"sharding='zero3'\): use one of auto, fsdp, none"),
        ({"layout": "megatron"}, r"layout='megatron'\): use one of holmes, nic_unaware, flat_fsdp"),
        ({"pp": 0}, r"^HolmesStrategy\(pp=0\): use a positive number of stages"),
        ({"global_batch": 8, "microbatches": 2.5}, r"^HolmesStrategy\(microbatches=2.5\): use a positive count"),
        ({"microbatches": 2}, r"^HolmesStrategy\(microbatches=2\): also give global_batch="),
        ({"global_batch": True}, r"^HolmesStrategy\(global_batch=True\): use a positive number of samples"),
    ],
)
def test_bad_arguments_fail_at_construction(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HolmesStrategy(cluster="two_cluster_mixed", **arguments)


@pytest.mark.parametrize(
    ("degrees", "message"),
    [
        ({"pp": 3}, r"pp=3 does not divide the 4 ranks of 'two_cluster_mixed'"),
        ({"pp": 2, "cluster": "three_cluster"}, r"pp=2 \(dp=4\): every stage must hold one NIC kind .* dp in \[1, 2\]"),
        ({"pp": 2, "dp": 1}, r"pp=2 x dp=1 = 2 ranks, but 'two_cluster_mixed' has 4"),
        ({"global_batch": 16, "microbatches": 3}, r"splits global_batch=16:\n.*microbatches=3 does not divide"),
        ({"pp": 2, "global_batch": 3}, r"global_batch=3 does not split over dp=2 ranks; use a multiple of 2"),
        ({"pp": 4, "global_batch": 2}, r"1F1B needs microbatches >= stages, got 2 < 4 .* or schedule GPipe"),
        ({"global_batch": 8, "microbatches": 3, "schedule": "auto"}, r"microbatches=3 does not divide the 4 samples"),
    ],
)
def test_degrees_no_layout_takes_fail_when_the_trainer_is_built(degrees: dict[str, int], message: str) -> None:
    """Before Lightning's launcher starts any process (the Trainer is built here, in this one); so does a global
    batch that none of the degrees left splits into micro-batches a schedule takes (it failed on every rank)."""
    settings = {"cluster": "two_cluster_mixed", **degrees}
    devices = Topology.from_config(settings["cluster"]).world_size
    with pytest.raises(PlanError, match=message):
        L.Trainer(accelerator="cpu", devices=devices, strategy=HolmesStrategy(**settings))


def test_one_stage_is_left_to_the_model_it_runs() -> None:
    """pp=1 on two clusters: a module without the pipeline contract runs FSDP over every rank, so the Trainer builds."""
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=HolmesStrategy(cluster="two_cluster_mixed", pp=1))
    assert trainer.strategy.cluster_environment.configured.world_size == 4


def test_plan_options_and_shorthands_reach_the_planner_as_one_object() -> None:
    options = PlanOptions(memory_limit_gb=80.0, chunks_per_stage=3, schedule="GPipe", pp=4)
    strategy = HolmesStrategy(cluster="two_cluster_mixed", options=options, pp=2, sharding="none")
    assert strategy.options == replace(options, pp=2, sharding=Sharding.none)
    assert options.pp == 4, "the caller's options are not changed"
    with pytest.raises(ValueError, match=r"^PlanOptions\(schedule='ZB'\): use one of"):  # where it was written
        HolmesStrategy(options=PlanOptions(schedule="ZB"))


def test_train_py_plans_for_the_backend_its_ranks_use() -> None:
    assert [collective_backend(name) for name in ("cpu", "gpu", "cuda")] == ["gloo", "nccl", "nccl"]


@pytest.mark.parametrize("order", [("holmes_lightning", "lightning"), ("lightning", "holmes_lightning")])
def test_importing_the_package_registers_strategy_holmes_with_lightning(order: tuple[str, str], tmp_path) -> None:
    """In a fresh interpreter, whichever is imported first: `Trainer(strategy="holmes")` builds HolmesStrategy on
    $HOLMES_CLUSTER; a cluster that does not exist is refused naming it."""
    first, second = order
    trainer = "L.Trainer(strategy='holmes', accelerator='cpu', devices=2, logger=False)"
    code = (
        f"import os, {first}, {second}; import lightning as L; s = {trainer}.strategy; "
        "print(type(s).__name__, s.cluster, flush=True); "
        f"os.environ['HOLMES_CLUSTER'] = 'no_such_cluster'; {trainer}"
    )
    environment = {**os.environ, "HOLMES_CLUSTER": "single_node"}
    done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, cwd=tmp_path)
    assert done.stdout.split() == ["HolmesStrategy", "single_node"], done.stderr[-2000:]
    assert done.returncode != 0 and "no_such_cluster" in done.stderr


def test_the_planner_alone_loads_no_lightning() -> None:
    alone = "import sys, holmes_lightning.planner; print('lightning' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", alone], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.parametrize(
    ("settings", "collectives"),
    [
        ({}, 2),  # the loss's all-reduce and Lightning's stop broadcast
        ({"gradient_clip_val": 1.0}, 3),  # + the norm's all-reduce over the stages
        ({"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"}, 2),  # clipping by value: on each rank
        ({"checkpoint": True}, 3),  # + HolmesCheckpoint's stop vote
    ],
)
def test_the_closing_collectives_timed_at_job_start_are_those_the_training_step_runs(settings, collectives, tmp_path):
    settings = dict(settings)
    callbacks = [HolmesCheckpoint(tmp_path)] if settings.pop("checkpoint", False) else []
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=callbacks, **settings)
    assert step_collectives(trainer) == collectives
