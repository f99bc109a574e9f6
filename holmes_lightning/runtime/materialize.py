"""Models built on the meta device: each rank allocates only its stage's layers (only its FSDP shard of them) and
fills them with the values the whole model gets on one process.

Initialisation goes layer by layer: pipeline layer i draws from torch's default generator seeded with
`layer_seed(seed, i)`, so its values depend neither on which rank holds it nor on what the layers before it drew.
`init_layers(model)` applies this to a whole model (call it at the end of `__init__`: the one-process model then
starts from the same values; a weight or module several layers hold keeps its first holder's values, as on meta); the
strategy applies it to the layers a rank keeps, each on a full CPU copy of the layer (its "twin", taken while still on
meta) whose shard it then copies in: one layer's full size is the most it ever allocates beyond what the rank keeps.

A layer is initialised by the LightningModule's `init_layer(layer)` when it defines one, else by the
`reset_parameters()` of each of the layer's submodules that holds parameters or buffers.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable, Sequence
from itertools import chain

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from holmes_lightning.runtime.contract import ContractError
from holmes_lightning.runtime.ties import Tie, later_holders, relink


def layer_seed(seed: int, index: int) -> int:
    """The generator seed of pipeline layer `index` under the job's `seed` (well mixed: layers do not share streams)."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def is_meta(module: nn.Module) -> bool:
    """Some parameter or buffer of `module` has no storage yet (built under the meta device)."""
    return any(t.is_meta for t in chain(module.parameters(), module.buffers()))


def init_layers(model: nn.Module, seed: int | None = None) -> None:
    """Initialise every pipeline layer of `model` that has storage, each from its own seed (see the module docstring).

    `seed`: default `torch.initial_seed()`, the seed `seed_everything` (or `torch.manual_seed`) set. Layers on the
    meta device are left to HolmesStrategy, which initialises them the same way once a rank has allocated them.
    The global random state is the same afterwards as before.
    """
    seed = torch.initial_seed() if seed is None else seed
    done: set[int] = set()  # tensors an earlier layer initialised: a weight several layers hold keeps the first's
    for index, layer in enumerate(model.pipeline_layers()):
        if layer is not None and not is_meta(layer):
            tensors = layer.state_dict(keep_vars=True)
            kept = {name: tensor.detach().clone() for name, tensor in tensors.items() if id(tensor) in done}
            init_layer(model, layer, index=index, seed=seed)
            with torch.no_grad():
                for name, value in kept.items():
                    tensors[name].copy_(value)
            done.update(id(tensor) for tensor in tensors.values())


def init_layer(model: nn.Module, layer: nn.Module, *, index: int, seed: int) -> None:
    """Initialise one layer with the model's `init_layer`, or its submodules' `reset_parameters`, from its own seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, index))
        custom = getattr(model, "init_layer", None)
        if callable(custom):
            custom(layer)
        else:
            _reset_parameters(layer, index, type(model).__name__)


def _reset_parameters(layer: nn.Module, index: int, model_name: str) -> None:
    holders = [
        m
        for m in layer.modules()
        if next(chain(m.parameters(recurse=False), m.buffers(recurse=False)), None) is not None
    ]
    missing = sorted({type(m).__name__ for m in holders if not callable(getattr(m, "reset_parameters", None))})
    if missing:
        raise ContractError(
            f"pipeline_layers()[{index}] was built on the meta device and holds {', '.join(missing)}, which have no "
            f"reset_parameters(); define `def init_layer(self, layer: nn.Module) -> None` on {model_name} to "
            f"initialise a layer's parameters and buffers"
        )
    for module in holders:
        module.reset_parameters()


def meta_twins(layers: Sequence[nn.Module], owned: Iterable[int]) -> dict[int, nn.Module]:
    """Copies of the owned layers while they are plain meta modules (sharding changes them): free, no storage."""
    return {index: copy.deepcopy(layers[index]) for index in owned}


def materialize(
    model: nn.Module,
    *,
    layers: Sequence[nn.Module],
    twins: dict[int, nn.Module],
    device: torch.device,
    seed: int,
    ties: Sequence[Tie] = (),
) -> None:
    """Allocate the owned layers' tensors on `device` (FSDP: the local shard only), then fill each from its twin.

    `twins` (from `meta_twins`, before sharding) name the owned layers; they are used up. Each twin is allocated in
    full on the CPU, initialised, copied in (DTensor parameters take their local shard) and dropped before the next.
    A weight several owned layers hold (`ties`) stays one parameter, with its first holder's values.
    """
    for index in twins:
        layers[index]._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    relink(layers, ties, set(twins))
    taken = later_holders(ties, set(twins))
    stray = [name for name, t in chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if stray:
        raise ContractError(
            f"{type(model).__name__} keeps {stray[:5]} on the meta device outside its pipeline_layers(); only the "
            f"layers are materialised: create other tensors on a real device (e.g. `with torch.device('cpu'):`)"
        )
    for index in list(twins):
        twin = twins.pop(index).to_empty(device="cpu")  # dropped after its copy: one full layer at a time
        init_layer(model, twin, index=index, seed=seed)
        _copy_into(layers[index], twin, skip=taken.get(index, set()))


@torch.no_grad()
def _copy_into(layer: nn.Module, twin: nn.Module, skip: set[str]) -> None:
    """Copy a full twin's values into `layer` but for `skip`; a DTensor takes its local part (split here, no
    communication)."""
    sources = dict(chain(twin.named_parameters(remove_duplicate=False), twin.named_buffers()))
    for name, target in chain(layer.named_parameters(remove_duplicate=False), layer.named_buffers()):
        if name in skip:
            continue
        source = sources[name]
        if isinstance(target, DTensor):
            source = distribute_tensor(source, target.device_mesh, target.placements, src_data_rank=None).to_local()
            target = target.to_local()
        target.copy_(source)
