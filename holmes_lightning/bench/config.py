"""Structured configs of `python -m holmes_lightning.bench` (conf/benchmark.yaml, sizes in conf/bench/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from holmes_lightning.cli.config import ConfigError, HFModelConfig, ModelConfig, StrategyConfig
from holmes_lightning.planner import Schedule
from holmes_lightning.topology import shipped_cluster_names
from holmes_lightning.topology.spec import ClusterSpec

VARIANTS = ("holmes_hybrid", "holmes_homogeneous", "fsdp", "ddp", "nic_unaware", "holmes_unequal", "uniform_unequal")
FREE_CHOICE = "holmes_free"  # Holmes with no degree, partition or sharding pinned (bench=paper_regime runs it too)
MEMORY_VARIANTS = ("memory_fsdp", "memory_replicas", "memory_eager")
AC_VARIANTS = ("memory_fsdp_ac_off", "memory_fsdp_ac_full", "memory_fsdp_ac_selective")  # bench.activations' job
OVERHEAD_VARIANTS = ("plain", "holmes")
SITES_VARIANTS = ("homogeneous", "pipeline", "flat_dp", "diloco")
KINDS = {
    "speed": (*VARIANTS, FREE_CHOICE),
    "memory": (*MEMORY_VARIANTS, *AC_VARIANTS),
    "overhead": OVERHEAD_VARIANTS,
    "regret": tuple(shipped_cluster_names()),
    "elastic": tuple(shipped_cluster_names()),
    "sites": SITES_VARIANTS,
}


@dataclass
class RegimeMatch:
    """The setting whose predicted step the lab job reproduces (`bench=paper_regime`), and the lab jobs to pick from.

    The reference: `model` on `cluster` at `global_batch` sequences per step, planned with the plan CLI's defaults.
    The lab job: a GPT of `n_layers` blocks, width in `d_models` (heads of `head_dim`), sequence in `seq_lens`, global
    batch in `global_batches`, and any bandwidth scale the lab shapes exactly. The bench picks the one whose
    predicted homogeneous step splits into compute, DP sync, p2p and bubble as the reference's does (each share
    within `share_tolerance`) and whose predicted ratios to the NIC-unaware layout, flat FSDP2 and DDP come closest
    to the reference's (relative, in units of `ratio_tolerance`), among those whose runs' steps fit
    `measured_budget_s` in all and whose Holmes step is predicted to last at least `min_step_s` (so that what a
    step costs outside the cost model, Lightning's loop and the data loader, stays small next to it). The chosen job
    is then timed again, each distinct layer for `calibration_seconds`, and its batch and bandwidth scale derived
    again on those costs, the ones its runs are planned and predicted with.
    """

    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    model: ModelConfig = field(default_factory=ModelConfig)
    global_batch: int = 512
    share_tolerance: float = 0.10
    ratio_tolerance: float = 0.10
    n_layers: int = 8
    d_models: list[int] = field(default_factory=lambda: [192, 256, 384])
    seq_lens: list[int] = field(default_factory=lambda: [128, 256])
    global_batches: list[int] = field(default_factory=lambda: [16, 32, 64])
    head_dim: int = 64
    measured_budget_s: float = 360.0
    min_step_s: float = 1.0
    calibration_seconds: float = 12.0

    def __post_init__(self) -> None:
        if self.global_batch <= 0:
            raise ConfigError(f"bench.match.global_batch={self.global_batch!r}: must be > 0 (sequences per step)")
        for name in ("share_tolerance", "ratio_tolerance", "measured_budget_s", "min_step_s", "calibration_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"bench.match.{name}={getattr(self, name)!r}: must be > 0")
        for name in ("d_models", "seq_lens", "global_batches"):
            values = list(getattr(self, name))
            if not values or min(values) <= 0:
                raise ConfigError(f"bench.match.{name}={values!r}: give one or more positive values")
        if any(width % self.head_dim for width in self.d_models):
            raise ConfigError(
                f"bench.match.d_models={list(self.d_models)!r}: each must be a multiple of "
                f"bench.match.head_dim={self.head_dim}"
            )


@dataclass
class ActivationsJob:
    """The memory bench's activation checkpointing runs (`AC_VARIANTS`): a GPT whose activations outweigh its weights'
    state, `global_batch` sequences per step in `microbatches` micro-batches (pinned: the runs differ only in what
    they checkpoint)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    global_batch: int = 8
    microbatches: int = 2

    def __post_init__(self) -> None:
        for name in ("global_batch", "microbatches"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"bench.activations.{name}={getattr(self, name)!r}: must be > 0")


@dataclass
class ElasticJob:
    """The elastic bench's job on each cluster: a checkpoint every `every_n_steps` steps; `kill_delay_s` after the
    checkpoint number `checkpoints_before` is complete, rank `kill_rank` (null: the last) is SIGKILLed; after the
    restart the job trains until `checkpoints_after` more. Tokens/s are measured between checkpoints of one launch, so
    each side needs two at least."""

    every_n_steps: int = 4
    checkpoints_before: int = 3
    checkpoints_after: int = 4
    kill_rank: int | None = None
    kill_delay_s: float = 0.5

    def __post_init__(self) -> None:
        if self.every_n_steps <= 0:
            raise ConfigError(f"bench.elastic.every_n_steps={self.every_n_steps!r}: must be > 0")
        for name in ("checkpoints_before", "checkpoints_after"):
            if getattr(self, name) < 2:
                raise ConfigError(
                    f"bench.elastic.{name}={getattr(self, name)!r}: must be >= 2 (tokens/s are measured between two)"
                )
        if self.kill_rank is not None and self.kill_rank < 0:
            raise ConfigError(f"bench.elastic.kill_rank={self.kill_rank!r}: must be >= 0, or null for the last rank")
        if self.kill_delay_s < 0:
            raise ConfigError(f"bench.elastic.kill_delay_s={self.kill_delay_s!r}: must be >= 0")

    @property
    def kill_step(self) -> int:
        """The step of the checkpoint after which the rank dies."""
        return self.every_n_steps * self.checkpoints_before

    @property
    def max_steps(self) -> int:
        return self.every_n_steps * (self.checkpoints_before + self.checkpoints_after)


@dataclass
class SitesJob:
    """The cross-site bench's job on `cluster` (sites a slow WAN apart): the homogeneous limit and DiLoCo (an outer
    step every H of `sync_every` inner steps, each all-reduce overlapping `overlap_steps` inner steps) train
    `max_steps` steps, their losses compared over the last `final_window`; the pipeline across the WAN and flat DP,
    synchronous as the homogeneous run is but far slower, run `short_steps` steps for their tokens/s."""

    cluster: str = "two_sites_1gbps"
    max_steps: int = 120
    short_steps: int = 10
    sync_every: list[int] = field(default_factory=lambda: [10, 50])
    overlap_steps: int = 8
    final_window: int = 10

    def __post_init__(self) -> None:
        if self.cluster not in shipped_cluster_names():
            raise ConfigError(f"bench.sites.cluster={self.cluster!r}: use a shipped cluster config with 2+ sites")
        if not self.sync_every or min(self.sync_every) <= self.overlap_steps or max(self.sync_every) >= self.max_steps:
            raise ConfigError(
                f"bench.sites.sync_every={list(self.sync_every)!r}: give one or more H above "
                f"bench.sites.overlap_steps={self.overlap_steps} and below bench.sites.max_steps={self.max_steps}"
            )
        for name in ("short_steps", "final_window", "overlap_steps"):
            if not 1 <= getattr(self, name) <= self.max_steps:
                raise ConfigError(f"bench.sites.{name}={getattr(self, name)!r}: use 1 to bench.sites.max_steps")


@dataclass
class BenchSettings:
    """One benchmark size: the model, batch and steps every variant runs, and how the cost model is calibrated.

    `kind`: "speed" (step times in the lab, `VARIANTS` and `FREE_CHOICE`), "memory" (each rank's peak memory next to
    the planner's estimate, on loopback: `MEMORY_VARIANTS` train `model`, `AC_VARIANTS` the `activations` job with
    activation checkpointing off, full and selective), "overhead" (HolmesStrategy on one device against plain
    Lightning, alternated `repeats` times, `bench.overhead`), "regret" (every configuration of a small job on each
    shipped cluster config named in `variants`, measured, against the planner's choice; `bench.regret`) or "elastic"
    (train.py on each cluster named in `variants`, a rank killed, the restart's phases and tokens/s before and after;
    `elastic`, `bench.elastic`) or "sites" (train.py across sites a slow WAN apart: one pipeline, flat DP, DiLoCo
    and the homogeneous limit, `sites`, `bench.sites`).
    `match`: derive the model, global batch and bandwidth scale from a reference setting instead (`RegimeMatch`).
    `prediction_tolerance`: how far each run's predicted step may be from the measured one. `calibration_seconds`: how
    long each distinct layer of the model is timed (`holmes_lightning.measure.calibration`).

    `hf_model`: a transformers causal LM (train.py's `model=hf_*` schema) trained through `HFCausalLM` on dict
    batches: the speed and regret benches train it instead of the GPT, the overhead bench besides it.

    `slow_cluster` runs its NIC at `slow_nic_gbps` in the unequal-clusters topology (auto vs uniform partition).
    `schedules`: bench=regret plans every configuration with each of these (None: the job's `strategy.schedule`),
    and the planner's free choice takes `schedule=auto`; a speed bench adds a Holmes run with each (`bench.bubbles`:
    its busiest rank's waits measured next to the predicted bubble).
    `bandwidth_scale` None: chosen from this CPU as `lab.scale` does, once, for every variant. What Holmes plans
    (degrees, schedule, sharding; `costs.dp_overlap`) is the job config's `strategy` node, as for train.py.
    """

    name: str = "short"
    kind: str = "speed"
    model: ModelConfig = field(default_factory=ModelConfig)
    global_batch: int = 8
    warmup_steps: int = 2
    measured_steps: int = 5
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    bandwidth_scale: float | None = None
    slow_cluster: str = "B"
    slow_nic_gbps: float = 50.0
    calibration_seconds: float = 1.5
    corpus_bytes: int = 400_000
    trace: bool = False
    timeout_s: float = 600.0
    repeats: int = 1
    prediction_tolerance: float = 0.15
    match: RegimeMatch | None = None
    hf_model: HFModelConfig | None = None
    activations: ActivationsJob | None = None
    elastic: ElasticJob | None = None
    sites: SitesJob | None = None
    schedules: list[Schedule] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"bench.kind={self.kind!r}: use one of {list(KINDS)}")
        known = KINDS[self.kind]
        if not self.variants or any(v not in known for v in self.variants):
            raise ConfigError(
                f"bench.variants={list(self.variants)!r}: for bench.kind={self.kind}, use a non-empty subset of "
                f"{list(known)}"
            )
        if self.global_batch <= 0:
            raise ConfigError(f"bench.global_batch={self.global_batch!r}: must be > 0 (sequences per step)")
        if self.warmup_steps < 1 or self.measured_steps < 1:
            raise ConfigError(
                f"bench.warmup_steps={self.warmup_steps}, bench.measured_steps={self.measured_steps}: both must be >= 1"
            )
        if self.bandwidth_scale is not None and not self.bandwidth_scale > 0:
            raise ConfigError(f"bench.bandwidth_scale={self.bandwidth_scale!r}: must be > 0, or null to choose one")
        if not self.slow_nic_gbps > 0:
            raise ConfigError(f"bench.slow_nic_gbps={self.slow_nic_gbps!r}: must be > 0, e.g. 50")
        if self.repeats < 1:
            raise ConfigError(f"bench.repeats={self.repeats!r}: must be >= 1")
        if not self.prediction_tolerance > 0:
            raise ConfigError(f"bench.prediction_tolerance={self.prediction_tolerance!r}: must be > 0, e.g. 0.05")
        if self.hf_model is not None and (self.kind in ("memory", "elastic") or self.match is not None):
            raise ConfigError(
                f"bench.hf_model with bench.kind={self.kind}{' and bench.match' if self.match else ''}: this bench "
                f"sizes the recipe's GPT; drop bench.hf_model (bench=hf, bench=overhead and bench=regret take it)"
            )
        if self.activations is None and set(self.variants) & set(AC_VARIANTS):
            raise ConfigError(
                f"bench.variants={list(self.variants)!r}: the activation checkpointing runs train bench.activations "
                f"(model, global_batch, microbatches); give it, as conf/bench/memory.yaml does"
            )
        if (self.kind == "elastic") != (self.elastic is not None):
            raise ConfigError(
                f"bench.elastic with bench.kind={self.kind}: give bench.elastic (the job's checkpoints and the rank "
                f"killed) exactly when bench.kind=elastic, as conf/bench/elastic.yaml does"
            )
        if (self.kind == "sites") != (self.sites is not None):
            raise ConfigError(
                f"bench.sites with bench.kind={self.kind}: give bench.sites exactly when bench.kind=sites, as "
                f"conf/bench/sites.yaml does"
            )
        if self.schedules is not None and (not self.schedules or any(Schedule(s).chosen for s in self.schedules)):
            raise ConfigError(
                f"bench.schedules={self.schedules!r}: list the schedules to plan every configuration with, e.g. "
                f"[1F1B, ZBVZeroBubble], or null for the job's strategy.schedule"
            )
        if self.calibration_seconds < 0:
            raise ConfigError(f"bench.calibration_seconds={self.calibration_seconds!r}: must be >= 0, e.g. 1.5")

    @property
    def steps(self) -> int:
        return self.warmup_steps + self.measured_steps


@dataclass
class BenchJobConfig:
    """The hybrid cluster every variant derives from, the benchmark size, what Holmes plans, and where results go."""

    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    bench: BenchSettings = field(default_factory=BenchSettings)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    output_dir: str = "outputs/bench"


def register_bench_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="base_bench_config", node=BenchJobConfig)
    store.store(group="bench", name="base_bench", node=BenchSettings)
