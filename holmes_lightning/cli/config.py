"""Hydra structured configs for `train.py` and the CLIs: the schema every YAML under `conf/` is checked against."""

from __future__ import annotations

import re
from dataclasses import MISSING, asdict, dataclass, field, fields, make_dataclass
from typing import Any, get_type_hints

import omegaconf
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException, OverrideParseException

from holmes_lightning.planner import MachineCosts, PlanOptions, SettingError
from holmes_lightning.planner.sites import CrossSite, DiLoCoSettings
from holmes_lightning.topology import ConfigEnum
from holmes_lightning.topology.spec import ClusterSpec


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field, the value and the fix."""


def error_line(err: BaseException) -> str:
    """A config error as one line that names the key and the fix (Hydra's own messages span several lines)."""
    message = str(err).strip()
    if isinstance(err, OverrideParseException):  # Hydra does not say which override; values with `=` need quotes
        return f"{err.override}: {message.splitlines()[0]} (quote a value with = or spaces: key='a=b')"
    if isinstance(err, ConfigCompositionException) and err.__cause__:  # "Could not override x" + why
        first, *rest = message.splitlines()
        message = "\n".join([f"{first.rstrip('.')}: {str(err.__cause__).splitlines()[0]}", *rest])
    message = message.split("\nConfig search path")[0]
    message = re.sub(r"\n\t", ", ", re.sub(r":\n\t", ": ", message))  # Hydra's option lists: "a:\n\tb\n\tc"
    return "; ".join(line.strip() for line in message.splitlines() if line.strip())


def _require(ok: bool, field_name: str, value: object, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}={value!r}: {fix}")


@dataclass
class ModelConfig:
    """A GPT shape (byte-level vocabulary by default, so nothing is downloaded).

    `_target_`: your LightningModule instead (`my_package.MyModule`), built by `hydra.utils.instantiate` from the keys
    you add (`+model.some_arg=3`); of the GPT fields only `seq_len` is then used, by the built-in data.
    """

    name: str = "gpt_tiny"
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    seq_len: int = 128
    vocab_size: int = 256
    dropout: float = 0.0
    _target_: str | None = None

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "seq_len"):
            _require(getattr(self, name) > 0, f"model.{name}", getattr(self, name), "must be > 0")
        _require(self.vocab_size >= 256, "model.vocab_size", self.vocab_size, "byte-level tokens need at least 256")
        _require(
            self.d_model % self.n_heads == 0,
            "model.d_model",
            self.d_model,
            f"must be a multiple of model.n_heads={self.n_heads}",
        )
        _require(0 <= self.dropout < 1, "model.dropout", self.dropout, "must be in [0, 1)")


@dataclass
class LoraSettings:
    """A LoRA adapter trained in place of the model's weights, which stay frozen: the fields of peft's `LoraConfig`,
    same names and defaults but `r`, whose default 0 means no adapter. `target_modules`: module names, "all-linear",
    or null for peft's default for the model's type."""

    r: int = 0
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    target_modules: Any = None
    use_dora: bool = False
    use_rslora: bool = False
    modules_to_save: list[str] | None = None

    def __post_init__(self) -> None:
        _require(self.r >= 0, "model.lora.r", self.r, "must be > 0 for an adapter, or 0 for none")


@dataclass
class HFModelConfig:
    """A transformers causal LM trained as `HFCausalLM`: random weights from `config` (an HF config written out,
    `model_type` and its fields), or the local HF directory `pretrained` (its config.json and safetensors weights;
    `config` is then not used). `seq_len`: tokens per training sequence. `lora`: an adapter to train instead of the
    weights (`model.lora.r=16`)."""

    name: str = "hf"
    config: dict[str, Any] = field(default_factory=dict)
    pretrained: str | None = None
    seq_len: int = 128
    lora: LoraSettings = field(default_factory=LoraSettings)

    @property
    def base_read_at_start(self) -> bool:
        """Whether the weights that do not train are those of `pretrained`, read at every start: a LoRA adapter's."""
        return self.pretrained is not None and self.lora.r > 0

    def __post_init__(self) -> None:
        _require(self.seq_len > 0, "model.seq_len", self.seq_len, "must be > 0")
        fix = "write an HF config (model_type: llama, hidden_size: ..., ...) or give model.pretrained=DIR"
        _require(self.pretrained is not None or "model_type" in self.config, "model.config", self.config, fix)


class BatchFormat(ConfigEnum):
    """How the built-in data hands out a batch: `(inputs, targets)` tensors, or HF's dicts (input_ids, labels,
    attention_mask)."""

    pairs = "pairs"
    dicts = "dicts"


@dataclass
class DataConfig:
    """What the job trains on, `global_batch` sequences per step over all replicas: by default a fixed slice of the
    Python standard library's sources as bytes; else a local text file (`text_file`) or a `datasets` dataset saved
    on disk (`dataset_dir`, its `column` of token ids or text; null: `input_ids`, else `text`), tokenised by the
    pretrained model's tokenizer or as bytes; or your LightningDataModule (`_target_`, built from the keys you add:
    `+data.some_arg=3`). Every built-in source splits into train and val and yields pairs for the GPT, dicts for HF
    models and, for your own module, pairs unless `batch_format=dicts`.
    """

    global_batch: int = 16
    num_workers: int = 0
    val_fraction: float = 0.05
    corpus_bytes: int = 2_000_000
    text_file: str | None = None
    dataset_dir: str | None = None
    column: str | None = None
    batch_format: BatchFormat | None = None
    _target_: str | None = None

    def __post_init__(self) -> None:
        _require(self.global_batch > 0, "data.global_batch", self.global_batch, "must be > 0 (sequences per step)")
        _require(self.num_workers >= 0, "data.num_workers", self.num_workers, "must be >= 0")
        _require(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "must be in (0, 1), e.g. 0.05")
        _require(self.corpus_bytes > 0, "data.corpus_bytes", self.corpus_bytes, "must be > 0, e.g. 2000000")
        sources = {"text_file": self.text_file, "dataset_dir": self.dataset_dir, "_target_": self._target_}
        given = [f"data.{key}={value}" for key, value in sources.items() if value is not None]
        if len(given) > 1:
            raise ConfigError(f"{' and '.join(given)}: give one source of data, not several")
        fix = "name a column of data.dataset_dir, or leave it null"
        _require(self.column is None or self.dataset_dir is not None, "data.column", self.column, fix)
        self.batch_format = None if self.batch_format is None else BatchFormat(self.batch_format)


def _editable(frozen: type) -> type:
    """The fields of a frozen dataclass as a plain one, for a Hydra node (Hydra cannot override a frozen node)."""
    hints = get_type_hints(frozen)
    return make_dataclass(
        f"{frozen.__name__}Config",
        [(f.name, hints[f.name], field(default=f.default)) for f in fields(frozen) if f.default is not MISSING],
    )


MachineCostsConfig = _editable(MachineCosts)  # `strategy.costs.latency_s=...`: one schema, the MachineCosts fields


@dataclass
class StrategyConfig(PlanOptions):
    """HolmesStrategy's settings: what to plan (`PlanOptions`), the micro-batch count, whether to calibrate the cost
    model on this machine at start (`HolmesStrategy(calibrate=...)`), the collective timeout, the machine's costs
    where they are not calibrated (`strategy.costs`, `MachineCosts`: all of them with `calibrate=false`, else those
    calibration does not measure, such as `dp_overlap`), and whether a resume plans afresh (`replan=true`) instead of
    running its checkpoint's plan again (`HolmesStrategy(replan=...)`); `cross_site`: one pipeline across every
    cluster, or DiLoCo over sites (`diloco.*`, `HolmesStrategy(cross_site=...)`)."""

    partition: Any = "auto"  # "auto", "uniform" or a list of layer counts (Hydra takes no union of str and list)
    microbatches: int | None = None
    calibrate: bool = True
    replan: bool = False
    timeout_s: float | None = None  # null: 120 s for ranks train.py starts on this machine, 30 min under torchrun/SLURM
    costs: MachineCostsConfig = field(default_factory=MachineCostsConfig)
    cross_site: CrossSite = CrossSite.pipeline

    def __post_init__(self) -> None:
        self.cross_site = CrossSite(self.cross_site)
        try:
            super().__post_init__()
            self.machine_costs()
        except SettingError as error:
            owner = "strategy.costs." if error.owner == MachineCosts.__name__ else "strategy."
            raise ConfigError(str(error.as_written_in(owner))) from None
        timeout = self.timeout_s
        _require(timeout is None or timeout > 0, "strategy.timeout_s", timeout, "must be > 0 seconds, or null")
        micro = self.microbatches
        _require(
            micro is None or micro > 0, "strategy.microbatches", micro, "must be > 0, or null to let the planner pick"
        )

    def machine_costs(self) -> MachineCosts:
        return MachineCosts(**asdict(self.costs))


@dataclass
class TrainerConfig:
    """Lightning Trainer settings plus the optimizer's (AdamW, linear warmup then cosine decay)."""

    accelerator: str = "cpu"
    max_steps: int = 30
    precision: str = "32-true"
    gradient_clip_val: float | None = 1.0
    accumulate_grad_batches: int = 1
    log_every_n_steps: int = 5
    val_check_interval: int | None = None
    limit_val_batches: int = 4
    learning_rate: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.1

    def __post_init__(self) -> None:
        accelerators = ("cpu", "gpu", "cuda", "auto")
        _require(
            self.accelerator in accelerators, "trainer.accelerator", self.accelerator, f"use one of {accelerators}"
        )
        precisions = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")  # Lightning's
        _require(self.precision in precisions, "trainer.precision", self.precision, f"use one of {precisions}")
        for name in ("max_steps", "accumulate_grad_batches", "log_every_n_steps", "learning_rate"):
            _require(getattr(self, name) > 0, f"trainer.{name}", getattr(self, name), "must be > 0")
        for name in ("limit_val_batches", "warmup_steps", "weight_decay"):
            _require(getattr(self, name) >= 0, f"trainer.{name}", getattr(self, name), "must be >= 0")
        clip = self.gradient_clip_val
        _require(clip is None or clip > 0, "trainer.gradient_clip_val", clip, "must be > 0, or null for no clipping")
        interval = self.val_check_interval
        _require(interval is None or interval > 0, "trainer.val_check_interval", interval, "must be > 0, or null")
        _require(
            self.warmup_steps < self.max_steps,
            "trainer.warmup_steps",
            self.warmup_steps,
            f"must be below trainer.max_steps={self.max_steps}",
        )


@dataclass
class CheckpointConfig:
    """Checkpoints `step_00000N.ckpt` in `dir` every `every_n_steps` steps (null: only on SIGTERM), the `keep` newest;
    with `hf`, an HF model written at the end in the run directory's `hf` (`hf-site-NAME` per DiLoCo site).

    `dir` is shared by every run with the same output_dir, so `resume=auto` finds the newest complete one; on several
    nodes it must be a directory every node mounts (checked at start).
    """

    dir: str = "${output_dir}/checkpoints"
    every_n_steps: int | None = 10
    keep: int = 3
    grace_s: float | None = None  # seconds from SIGTERM to the kill, where SLURM's end time does not tell
    hf: bool = True  # at the end, an HF model's trained weights (a LoRA adapter's alone) as an HF directory `hf`

    def __post_init__(self) -> None:
        grace = self.grace_s
        _require(grace is None or grace > 0, "checkpoint.grace_s", grace, "must be > 0 seconds, or null")
        steps = self.every_n_steps
        _require(steps is None or steps > 0, "checkpoint.every_n_steps", steps, "must be > 0, or null (SIGTERM only)")
        _require(self.keep >= 1, "checkpoint.keep", self.keep, "must be >= 1 (the newest is the one to resume)")


class LabMode(ConfigEnum):
    """Where the ranks run: this machine as it is, or the lab's emulated network."""

    loopback = "loopback"
    emulate = "emulate"


@dataclass
class LabConfig:
    """Where the ranks run: `loopback` (this machine as it is) or `emulate` (the lab's shaped network, needs root)."""

    mode: LabMode = LabMode.loopback
    bandwidth_scale: float | None = None

    def __post_init__(self) -> None:
        self.mode = LabMode(self.mode)
        scale = self.bandwidth_scale
        fix = "must be > 0, e.g. 0.002 (200 Gb/s -> 400 Mb/s), or null to match this CPU"
        _require(scale is None or scale > 0, "lab.bandwidth_scale", scale, fix)


@dataclass
class ElasticConfig:
    """Restarts after a lost node on this machine's emulated nodes: a rank killed by a signal counts its node as
    lost; the job's ranks stop and start again on the nodes left, re-planned, from the last checkpoint, at most
    `max_restarts` times (0: a failure ends the job, as before) and never on fewer than `min_nodes` nodes (null: as
    few as still hold the model; the planner refuses fewer). Under DiLoCo (`strategy.cross_site=diloco`) a lost node
    stops its site only and the other sites train on without it, for up to `max_restarts` sites. On real clusters
    torchrun's elastic agent restarts (README)."""

    max_restarts: int = 0
    min_nodes: int | None = None

    def __post_init__(self) -> None:
        restarts, least = self.max_restarts, self.min_nodes
        _require(restarts >= 0, "elastic.max_restarts", restarts, "must be >= 0 (0: no restart)")
        _require(least is None or least >= 1, "elastic.min_nodes", least, "must be >= 1, or null (no floor)")


@dataclass
class DiLoCoConfig(_editable(DiLoCoSettings)):
    """DiLoCo across sites (`strategy.cross_site=diloco`, and as the plan CLI predicts it next to one pipeline): the
    `DiLoCoSettings` fields (`sync_every` inner steps between outer steps; `outer_bits` per pseudo-gradient value sent,
    32, 16 (bf16), or 8 and 4 quantised and all-gathered; `streaming` in `fragments`, each all-reduce running during the
    next `overlap_steps` inner steps; the outer Nesterov SGD's `outer_lr` and `outer_momentum`), plus `sites`: how the
    clusters group into sites (`A+B|C`; null: the fewest sites the links cut them into), and `allowed`:
    `strategy.cross_site=auto` may choose DiLoCo (it changes the optimisation, so only when you say so)."""

    sites: str | None = None
    allowed: bool = False

    def __post_init__(self) -> None:
        self.settings()

    def settings(self) -> DiLoCoSettings:
        try:
            return DiLoCoSettings(**{f.name: getattr(self, f.name) for f in fields(DiLoCoSettings)})
        except SettingError as error:
            raise ConfigError(str(error.as_written_in("diloco."))) from None


@dataclass
class TrainConfig:
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    model: Any = omegaconf.MISSING  # ModelConfig or HFModelConfig: the `model` group's choice brings its schema
    data: DataConfig = field(default_factory=DataConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    lab: LabConfig = field(default_factory=LabConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    seed: int = 1234
    resume: str | None = None  # a checkpoint directory, or "auto": the newest complete one in checkpoint.dir
    logger: str = "csv"
    output_dir: str = "outputs"


@dataclass
class PlanConfig:
    """The `plan` CLI's outputs (the plan settings themselves are `strategy.*`, as for train.py).

    `verbose`: also print what the search did (candidates, what its bounds cut, splits simulated).
    """

    out: str | None = None
    json: str | None = None
    bytes_per_value: int = 2
    verbose: bool = False

    def __post_init__(self) -> None:
        _require(self.bytes_per_value in (2, 4), "plan.bytes_per_value", self.bytes_per_value, "use 2 (bf16) or 4")


@dataclass
class PlanJobConfig:
    """`python -m holmes_lightning.cli.plan`: the job's hardware, model, batch and strategy, planned without running."""

    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    model: Any = omegaconf.MISSING  # ModelConfig or HFModelConfig: the `model` group's choice brings its schema
    data: DataConfig = field(default_factory=DataConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)


def register_configs() -> None:
    """Register the schemas so Hydra rejects unknown keys and wrong types in every config group."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=TrainConfig)
    store.store(group="cluster", name="base_cluster", node=ClusterSpec)
    store.store(group="model", name="base_model", node=ModelConfig)
    store.store(group="model", name="base_hf_model", node=HFModelConfig)
    store.store(group="strategy", name="base_strategy", node=StrategyConfig)
    store.store(group="trainer", name="base_trainer", node=TrainerConfig)
    store.store(group="lab", name="base_lab", node=LabConfig)
    store.store(name="base_plan_config", node=PlanJobConfig)
