"""Hydra structured configs for `train.py` and the CLIs: the schema every YAML under `conf/` is checked against."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from holmes_lightning.topology.spec import ClusterSpec


@dataclass
class ModelConfig:
    """A GPT shape (byte-level vocabulary by default, so nothing is downloaded)."""

    name: str = "gpt_tiny"
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    seq_len: int = 128
    vocab_size: int = 256
    dropout: float = 0.0


@dataclass
class DataConfig:
    global_batch: int = 16
    num_workers: int = 0
    val_fraction: float = 0.05


@dataclass
class StrategyConfig:
    schedule: str = "1F1B"
    microbatches: int | None = None
    partition: Any = "auto"
    pp: int | None = None
    dp: int | None = None
    sharding: str = "fsdp"
    timeout_s: float = 120.0


@dataclass
class TrainerConfig:
    accelerator: str = "cpu"
    max_steps: int = 30
    precision: str = "32-true"
    gradient_clip_val: float | None = 1.0
    accumulate_grad_batches: int = 1
    log_every_n_steps: int = 5
    val_check_interval: int | None = None
    learning_rate: float = 3e-3


@dataclass
class LabConfig:
    mode: str = "loopback"
    bandwidth_scale: float | None = None


@dataclass
class TrainConfig:
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    lab: LabConfig = field(default_factory=LabConfig)
    seed: int = 1234
    resume: str | None = None
    logger: str = "csv"
    output_dir: str = "outputs"


def register_configs() -> None:
    """Register the schemas so Hydra rejects unknown keys and wrong types in every config group."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=TrainConfig)
    store.store(group="cluster", name="base_cluster", node=ClusterSpec)
    store.store(group="model", name="base_model", node=ModelConfig)
    store.store(group="strategy", name="base_strategy", node=StrategyConfig)
    store.store(group="trainer", name="base_trainer", node=TrainerConfig)
    store.store(group="lab", name="base_lab", node=LabConfig)
