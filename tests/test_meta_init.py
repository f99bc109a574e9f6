"""Models bigger than a rank: built on the meta device, each rank allocates and initialises only its stage's layers.

A model that is not from recipes/ (built in `configure_model` or under `trainer.init_module(empty_init=True)`, no
`example_input_array`, a train_dataloader() sized by the plan, a layer with a buffer, a custom `init_layer`) trains on
pp=2 x dp=2 with FSDP and with replicas to the losses of one process that built it whole, and a fresh
`trainer.validate` plans from the validation DataLoader. One 4-rank launch runs every case.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import lightning as L
import pytest
import torch
from distributed import CLASSES, FEATURES, LossRecorder, quiet_trainer, run_ranks, tiny_loader
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from holmes_lightning.runtime.materialize import init_layer, init_layers, layer_seed

SEED, STEPS, GLOBAL_BATCH, DP = 11, 6, 16, 2
WIDTH = 24


class Scaled(nn.Module):
    """A linear map times a fixed per-feature scale held in a buffer (which `init_layer` must fill)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("scale", torch.empty(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * self.scale


class MetaMLP(L.LightningModule):
    """Pipeline layers built in `__init__` or in `configure_model`, on the meta device when `meta`."""

    def __init__(self, meta: bool, build_in: str) -> None:
        super().__init__()
        self.meta, self.build_in = meta, build_in
        self.layers: nn.ModuleList | None = None
        if build_in == "init":
            self._build()

    def configure_model(self) -> None:
        if self.layers is None:
            self._build()

    def _build(self) -> None:
        with torch.device("meta") if self.meta else nullcontext():
            pairs = [(FEATURES, WIDTH)] + [(WIDTH, WIDTH)] * 3
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in pairs])
            self.layers.append(Scaled(WIDTH))
            self.layers.append(nn.Linear(WIDTH, CLASSES))
        init_layers(self)

    def init_layer(self, layer: nn.Module) -> None:
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.4)
                nn.init.uniform_(module.bias, -0.1, 0.1)
        if isinstance(layer, Scaled):
            layer.scale.uniform_(0.5, 1.5)

    def pipeline_layers(self) -> list[nn.Module]:
        assert self.layers is not None
        return list(self.layers)

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(outputs, targets)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        for layer in self.pipeline_layers():
            inputs = layer(inputs)
        return inputs

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.pipeline_loss(self(batch[0]), batch[1])

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.pipeline_loss(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:  # sized by the plan, read by the strategy before it plans
        return tiny_loader(STEPS * GLOBAL_BATCH, self.trainer.strategy.replica_batch_size)


CASES = {
    "fsdp_configure_model": {"sharding": "fsdp", "build_in": "configure_model"},
    "replicas_init_module": {"sharding": "none", "build_in": "init"},
}


def _trainer(strategy: Any, nodes: int, recorder: LossRecorder | None = None) -> L.Trainer:
    callbacks = [recorder] if recorder else []
    return quiet_trainer(devices=1, num_nodes=nodes, strategy=strategy, max_steps=STEPS, callbacks=callbacks)


def _held(model: nn.Module) -> dict[str, Any]:
    """What this rank allocated: parameter values it holds (local shards), and whether anything is left on meta."""
    tensors = list(model.parameters()) + list(model.buffers())
    local = [t.to_local() if isinstance(t, DTensor) else t for t in model.parameters()]
    return {"numel": sum(t.numel() for t in local), "meta": any(t.is_meta for t in tensors)}


def meta_cases() -> dict[str, Any]:
    """Rank side: fit each case from a meta-built model; then validate a fresh meta model with a fresh strategy."""
    from holmes_lightning import HolmesStrategy

    results = {}
    for name, case in CASES.items():
        L.seed_everything(SEED)
        strategy = HolmesStrategy(
            cluster="two_cluster_mixed",
            pp=2,
            dp=DP,
            sharding=case["sharding"],
            global_batch=GLOBAL_BATCH,
            microbatches=4,
            timeout=120,
        )
        recorder = LossRecorder()
        trainer = _trainer(strategy, nodes=4, recorder=recorder)
        if case["build_in"] == "init":
            with trainer.init_module(empty_init=True):
                model = MetaMLP(meta=False, build_in="init")  # init_module puts it on meta
        else:
            model = MetaMLP(meta=True, build_in="configure_model")
        if case["build_in"] == "init":
            trainer.fit(model)  # its own train_dataloader()
        else:
            trainer.fit(model, tiny_loader(STEPS * GLOBAL_BATCH, GLOBAL_BATCH // DP))
        stage = strategy.plan.stages[strategy.plan_mesh.stage]
        results[name] = {"losses": recorder.losses, "held": _held(model), "layers": stage.layers}
    L.seed_everything(SEED)
    strategy = HolmesStrategy(cluster="two_cluster_mixed", pp=2, dp=DP, global_batch=GLOBAL_BATCH, microbatches=4)
    trainer = _trainer(strategy, nodes=4)
    metrics = trainer.validate(MetaMLP(meta=True, build_in="configure_model"), _val_loader(), verbose=False)
    results["validate"] = metrics[0]
    return results


def _val_loader() -> DataLoader:
    return tiny_loader(2 * GLOBAL_BATCH, GLOBAL_BATCH // DP, shuffle=False)


def single_process(build_in: str) -> list[float]:
    L.seed_everything(SEED)
    recorder = LossRecorder()
    loader = tiny_loader(STEPS * GLOBAL_BATCH, GLOBAL_BATCH, single_process_seed=SEED)
    _trainer("auto", nodes=1, recorder=recorder).fit(MetaMLP(meta=False, build_in=build_in), loader)
    return recorder.losses


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks("test_meta_init:meta_cases", timeout_s=400)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_meta_model_trains_like_one_process(name: str, ranks: list[dict[str, Any]]) -> None:
    reference = single_process(CASES[name]["build_in"])
    assert len(reference) == STEPS
    for rank, result in enumerate(ranks):
        assert result[name]["losses"] == pytest.approx(reference, rel=1e-4), f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_each_rank_allocates_only_its_stage(name: str, ranks: list[dict[str, Any]]) -> None:
    whole = MetaMLP(meta=False, build_in="init")
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in whole.pipeline_layers()]
    for result in ranks:
        held = result[name]["held"]
        stage = sum(sizes[i] for i in result[name]["layers"])
        assert not held["meta"]
        if CASES[name]["sharding"] == "fsdp":  # each parameter split over the 2 ranks of the stage, row-wise
            assert stage / DP - 2 * WIDTH <= held["numel"] <= stage / DP + 2 * WIDTH
        else:
            assert held["numel"] == stage


@pytest.mark.slow
def test_validate_on_its_own_plans_from_the_validation_data(ranks: list[dict[str, Any]]) -> None:
    L.seed_everything(SEED)
    model = MetaMLP(meta=False, build_in="init")
    reference = _trainer("auto", nodes=1).validate(model, tiny_loader(2 * GLOBAL_BATCH, GLOBAL_BATCH, shuffle=False))
    for result in ranks:
        assert result["validate"]["val_loss"] == pytest.approx(reference[0]["val_loss"], rel=1e-5)


def test_a_layer_gets_the_same_values_alone_as_in_the_whole_model() -> None:
    whole = MetaMLP(meta=False, build_in="init")
    state = torch.get_rng_state()
    init_layers(whole, seed=5)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is left as it was found
    with torch.device("meta"):
        split = MetaMLP(meta=False, build_in="init")
    layer = split.pipeline_layers()[4].to_empty(device="cpu")
    init_layer(split, layer, index=4, seed=5)  # alone, as the rank holding it does
    expected = whole.pipeline_layers()[4]
    for ours, theirs in zip([*layer.parameters(), layer.scale], [*expected.parameters(), expected.scale], strict=True):
        assert torch.equal(ours, theirs)
    assert layer_seed(5, 3) != layer_seed(5, 4) and layer_seed(5, 3) != layer_seed(6, 3)


def test_without_init_layer_each_layer_is_reset_and_a_shared_one_keeps_its_first_holders_values() -> None:
    """No `init_layer`: each submodule's `reset_parameters()`, from the layer's own seed. A block that layers 1 and 2
    both apply keeps layer 1's values, as a rank whose first layer of it is layer 1 gives it (and sends the rest)."""
    block = nn.Linear(4, 4)
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(4, 4), block, block])
    model.pipeline_layers = lambda: list(model.layers)
    init_layers(model, seed=5)
    for index in (0, 1):
        alone = nn.Linear(4, 4)
        init_layer(model, alone, index=index, seed=5)
        assert torch.equal(model.layers[index].weight, alone.weight)
