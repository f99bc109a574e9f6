"""The trained model handed back in its own format, written by every rank together: each stage's first DP rank
writes the tensors of its layers (gathered whole over the stage's shards) as one part, rank 0 what ties the parts
together. For a module that defines `save_pretrained_part(directory, layer_states, part=, parts=)` (returning what
it wrote, by key) and `finish_pretrained(directory, written)`: HFCausalLM, whose parts make an HF directory."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from holmes_lightning.planner import Plan
from holmes_lightning.runtime.groups import PlanMesh

EXPORT = ("save_pretrained_part", "finish_pretrained")


def save_pretrained(module: pl.LightningModule, directory: Path, *, plan: Plan, mesh: PlanMesh) -> None:
    """Write `module`'s trained weights in its own format (HF: a directory `from_pretrained` loads). Every rank calls
    it."""
    missing = [name for name in EXPORT if not callable(getattr(module, name, None))]
    if missing:
        raise TypeError(
            f"{type(module).__name__} defines no {' or '.join(missing)}: save_hf writes a Hugging Face model; train "
            f"an HFCausalLM (holmes_lightning.hf), or save with trainer.save_checkpoint"
        )
    layers = module.pipeline_layers()
    owned = plan.stages[mesh.stage].layers if plan.is_pipelined else range(len(layers))
    states = {index: _whole(layers[index]) for index in owned}  # every rank of the stage takes part in the gathers
    written = {}
    if mesh.dp_index == 0:
        written = module.save_pretrained_part(directory, states, part=mesh.stage, parts=plan.pp)
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, written)
    if dist.get_rank() == 0:
        module.finish_pretrained(directory, {key: where for found in everyone for key, where in found.items()})
    dist.barrier()


def _whole(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A layer's state dict with every tensor whole (a DTensor gathered over its mesh: a collective)."""
    return {key: t.full_tensor() if isinstance(t, DTensor) else t for key, t in layer.state_dict().items()}
