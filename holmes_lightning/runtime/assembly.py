"""This rank's part of the model, assembled from a Plan in torchtitan's order: keep the stage's layers, shard them over
the stage's DP mesh, allocate and initialise them if they were built on the meta device, then wrap the stage's chunks
in pipeline stages."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.init import _materialize_distributed_module
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from holmes_lightning.planner import Plan
from holmes_lightning.runtime.contract import (
    check_contract,
    check_uncompiled,
    keep_owned_layers,
    loss_weight,
    missing_contract,
)
from holmes_lightning.runtime.groups import PlanMesh
from holmes_lightning.runtime.materialize import is_meta, materialize, meta_twins
from holmes_lightning.runtime.pipeline import LayerChain, Pipeline
from holmes_lightning.runtime.recompute import checkpoint_layers
from holmes_lightning.runtime.sharding import parallelize
from holmes_lightning.runtime.ties import Tie, TiedCopies, across_stages


def assemble(
    module: pl.LightningModule,
    *,
    plan: Plan,
    mesh: PlanMesh,
    device: torch.device,
    mp_policy: MixedPrecisionPolicy,
    seed: Callable[[], int],
    ties: Sequence[Tie] = (),
    fsdp_on_one_rank: bool = False,
) -> Pipeline | None:
    """Make `module` this rank's part of `plan`; the Pipeline that runs its stage, or None without a pipeline (the
    module's own steps then run, FSDP2 or replicas over the DP mesh). `seed`: rank 0's seed, asked for (on every
    rank) only when layers are on the meta device. `ties`: the weights several of its layers hold (`find_ties`).
    `fsdp_on_one_rank`: FSDP2 also over a DP mesh of one rank (`sharding.parallelize`)."""
    layers = [] if missing_contract(module) else list(module.pipeline_layers())
    if len(layers) not in (0, plan.num_layers):
        raise ValueError(
            f"the plan splits {plan.num_layers} layers but {type(module).__name__}.pipeline_layers() returns "
            f"{len(layers)}; plan for this model"
        )
    stage = plan.stages[mesh.stage]
    owned = stage.layers if plan.is_pipelined else range(len(layers))
    # 1. keep this stage's layers (the others leave the module, its optimizer and checkpoint)
    if plan.is_pipelined:
        check_contract(module, plan.pp)
        if plan.schedule.splits_backward:
            check_uncompiled(layers, plan.schedule.value)
        keep_owned_layers(module, layers, set(owned))
        module.example_input_array = None  # the whole forward no longer runs here (model summary would call it)
    twins = meta_twins(layers, owned) if layers and is_meta(module) else {}
    # 2. activation checkpointing (before sharding: FSDP's hooks wrap the recomputing forward)
    checkpoint_layers(layers, owned, stage.checkpointing)
    shard = partial(parallelize, mesh=mesh.dp_mesh, plan=plan, mp_policy=mp_policy, fsdp_on_one_rank=fsdp_on_one_rank)
    if not plan.is_pipelined:
        # 3. shard (or replicate) over the stage's DP mesh, 4. allocate and initialise
        shard(module, layers=layers)
        _materialize(module, layers=layers, twins=twins, device=device, seed=seed, ties=ties)
        return None
    # virtual stages, possibly all on this rank (pp=1, Interleaved1F1B): 3. shard each chunk, 4. allocate, initialise
    chunks = [LayerChain(*layers[start:stop]) for start, stop in stage.chunks]
    syncs = [shard(chunk, layers=list(chunk)) for chunk in chunks]
    _materialize(module, layers=layers, twins=twins, device=device, seed=seed, ties=ties)
    # 5. copies of weights tied across stages start equal and sum their gradients; 6. the pipeline stages, schedule
    tied = TiedCopies(across_stages(ties, plan), layers, set(owned), mesh.tie_groups)
    tied.broadcast_values()
    syncs.append(tied.sum_gradients if tied.copies else None)
    return Pipeline(
        plan=plan,
        stage=mesh.stage,
        chunks=chunks,
        pp_group=mesh.pp_group,
        device=device,
        loss_fn=module.pipeline_loss,
        loss_weight=loss_weight(module),
        dp_group=mesh.dp_group if plan.dp > 1 else None,
        gradient_syncs=[sync for sync in syncs if sync is not None],
        hop_groups=mesh.hop_groups,
        tied=tied,
    )


def _materialize(
    module: pl.LightningModule,
    *,
    layers: list[nn.Module],
    twins: dict[int, nn.Module],
    device: torch.device,
    seed: Callable[[], int],
    ties: Sequence[Tie],
) -> None:
    """Meta layers: this rank's shards, each layer initialised from its own seed (rank 0's) as on one process.

    A meta model without `pipeline_layers()` gets Lightning's treatment: each submodule's `reset_parameters()`.
    """
    if twins:
        materialize(module, layers=layers, twins=twins, device=device, seed=seed(), ties=ties)
    else:
        _materialize_distributed_module(module, device)
