"""`python -m holmes_lightning.bench bench=memory`: each rank's peak memory next to the planner's per-device estimate.

Method: two jobs, each trained for the bench's steps with AdamW on the job's cluster (two_cluster_mixed: pp=2 x dp=2),
one process per rank on loopback (link speeds do not change memory).

- Weights (`MEMORY_VARIANTS`): the recipe's GPT in `bench.model`'s shape (conf/bench/memory.yaml: 16 layers x d_model
  1024, 0.81 GB of fp32 weights; its activations are a few percent of its memory). `memory_fsdp` and
  `memory_replicas` build it under `trainer.init_module(empty_init=True)`, so that each rank allocates only its stage
  (FSDP: its shard of it); `memory_eager` builds it whole on every rank first, as before meta-device support.
- Activations (`AC_VARIANTS`): `bench.activations`' GPT, narrow and long (16 x 256, seq 512), whose activations
  outweigh its weights' state, trained with FSDP and activation checkpointing off, full and selective, at pinned
  micro-batches and off's split so that the three runs differ only in what they checkpoint.

Each rank reports its resident memory just before the model is built (the baseline: interpreter, torch, Lightning,
the Trainer, the same for any model) and its peak, and how much of it is mapped from files at both ends: the code of
torch's libraries (libtorch_cpu) that training runs for the first time after the baseline (FSDP, gloo's collectives,
autograd's kernels) pages in ~26 MB, the same for any model and not memory training allocates. The model's memory is
the peak less the baseline and that code, which is what the planner estimates (`CostModel.memory_bytes`). The ranks
run with glibc's mmap threshold fixed (`ALLOCATOR_ENV`): by default
glibc raises it as large tensors are freed, after which freed tensors stay resident in its heaps and RSS counts
memory no tensor holds (about 0.5 x a stage's weights here); fixed, RSS follows the tensors, as
`torch.cuda.max_memory_allocated` does on a GPU.

Targets, per rank. Weights job, meta-built runs: model memory <= 1.25 x its stage's weights + gradients + AdamW
states (4 x the stage's parameter bytes), and the estimate within 20% of it. Activations job: the estimate within 15%
of the model memory with every checkpointing choice; the losses of every choice are reported beside off's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import matplotlib
import torch

from holmes_lightning.bench.config import AC_VARIANTS, ActivationsJob, BenchSettings
from holmes_lightning.bench.model import BenchModel
from holmes_lightning.bench.runner import rank_results, worker_command, write_spec
from holmes_lightning.bench.variants import Variant
from holmes_lightning.cli.config import ModelConfig, StrategyConfig
from holmes_lightning.launch.processes import launch
from holmes_lightning.planner import (
    Backend,
    BatchSettings,
    Checkpointing,
    ModelProfile,
    PlanOptions,
    Sharding,
    best_plan,
)
from holmes_lightning.topology import Topology

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GB = 1e9
STATE_TARGET = 1.25  # peak model memory per rank <= this x its stage's weights + grads + AdamW states
ESTIMATE_TOLERANCE = 0.2
AC_TOLERANCE = 0.15  # |estimate / model - 1| per rank of every activation checkpointing run
ADAMW_STATE_MULTIPLIER = 4  # fp32 weights, gradients and AdamW's two moments per parameter byte
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # tensors of 64 KB and more: their own pages, returned when freed
MODE_COLORS = {"off": "tab:red", "full": "tab:blue", "selective": "tab:green"}


@dataclass(frozen=True)
class MemoryRun:
    """What a memory variant runs: its sharding, whether its model is built on meta, and its activation checkpointing
    (None: the weights job, `bench.model`, as the strategy config asks; else the activations job)."""

    sharding: Sharding
    meta: bool = True
    checkpointing: Checkpointing | None = None


RUNS = {
    "memory_fsdp": MemoryRun(Sharding.fsdp),
    "memory_replicas": MemoryRun(Sharding.none),
    "memory_eager": MemoryRun(Sharding.none, meta=False),
    "memory_fsdp_ac_off": MemoryRun(Sharding.fsdp, checkpointing=Checkpointing.off),
    "memory_fsdp_ac_full": MemoryRun(Sharding.fsdp, checkpointing=Checkpointing.full),
    "memory_fsdp_ac_selective": MemoryRun(Sharding.fsdp, checkpointing=Checkpointing.selective),
}


@dataclass(frozen=True)
class MemoryRow:
    """One rank of one run: its stage's state, the planner's estimate and the measured memory, in GB (`code_gb`: file
    mapped pages, the libraries' code, that the rank paged in after its baseline); the run's activation checkpointing
    and this rank's loss per step."""

    variant: str
    rank: int
    stage: int
    layers: str
    stage_state_gb: float
    estimate_gb: float
    baseline_gb: float
    peak_gb: float
    code_gb: float = 0.0
    checkpointing: str = "off"
    losses: tuple[float, ...] = ()

    @property
    def model_gb(self) -> float:
        """The peak less the baseline and the library code paged in since (`code_gb`)."""
        return self.peak_gb - self.baseline_gb - self.code_gb

    @property
    def meta(self) -> bool:
        return RUNS[self.variant].meta

    @property
    def activations_job(self) -> bool:
        return self.variant in AC_VARIANTS

    @property
    def state_ratio(self) -> float:
        return self.model_gb / self.stage_state_gb

    @property
    def estimate_error(self) -> float:
        return self.estimate_gb / self.model_gb - 1

    @property
    def meets_targets(self) -> bool:
        if self.activations_job:
            return abs(self.estimate_error) <= AC_TOLERANCE
        return self.state_ratio <= STATE_TARGET and abs(self.estimate_error) <= ESTIMATE_TOLERANCE


@dataclass(frozen=True)
class MemoryVariant:
    """A planned memory run, what its ranks train (`trained`: model, global batch, steps) and its model's profile."""

    variant: Variant
    trained: BenchSettings
    profile: ModelProfile

    @property
    def name(self) -> str:
        return self.variant.name


def meta_profile(model: ModelConfig) -> ModelProfile:
    """The GPT's profile from shapes (FlopCounterMode and saved tensors on the meta device): nothing allocated."""
    with torch.device("meta"):
        return BenchModel(gpt=model).profile()


def activations_job(name: str, settings: BenchSettings) -> ActivationsJob | None:
    """`bench.activations` for the AC runs; None for the weights job's runs."""
    return None if RUNS[name].checkpointing is None else settings.activations


def trained_by(name: str, settings: BenchSettings) -> BenchSettings:
    """The settings variant `name`'s ranks train with: `bench.activations`' model and batch for the AC runs."""
    job = activations_job(name, settings)
    return settings if job is None else replace(settings, model=job.model, global_batch=job.global_batch)


def batch_of(name: str, settings: BenchSettings) -> BatchSettings:
    """The AC runs' micro-batches are pinned (the same schedule whatever they checkpoint); the others' planned."""
    job = activations_job(name, settings)
    return BatchSettings(settings.global_batch) if job is None else BatchSettings(job.global_batch, job.microbatches)


def options_of(name: str, requested: StrategyConfig) -> PlanOptions:
    """What the strategy config asks, on gloo, with the run's sharding (and checkpointing: the AC runs)."""
    run = RUNS[name]
    options = replace(requested.settings(), backend=Backend.gloo, sharding=run.sharding)
    return options if run.checkpointing is None else replace(options, activation_checkpointing=run.checkpointing)


def plan_memory_variants(hybrid: Topology, settings: BenchSettings, requested: StrategyConfig) -> list[MemoryVariant]:
    """Every requested memory variant with the plan the planner makes for it (each job profiled once, on meta)."""
    costs = requested.machine_costs()
    profiles: dict[bool, ModelProfile] = {}
    split: tuple[int, ...] | None = None  # the AC runs all take the split off's plan takes: only checkpointing differs
    planned = []
    for name in settings.variants:
        trained, job = trained_by(name, settings), activations_job(name, settings) is not None
        if job not in profiles:
            profiles[job] = meta_profile(trained.model)
        batch, options = batch_of(name, settings), options_of(name, requested)
        if job:
            if split is None:
                keeping = replace(options, activation_checkpointing=Checkpointing.off)
                off = best_plan(hybrid, profiles[job], batch, options=keeping, costs=costs)
                split = tuple(len(stage.layers) for stage in off.stages)
            options = replace(options, partition=split)
        plan = best_plan(hybrid, profiles[job], batch, options=options, costs=costs)
        planned.append(MemoryVariant(Variant(name, "holmes", hybrid, plan), trained, profiles[job]))
    return planned


def measure(planned: MemoryVariant, folder: Path) -> list[MemoryRow]:
    """Run one variant's ranks on loopback; a row per rank."""
    variant, profile = planned.variant, planned.profile
    spec = write_spec(
        [variant], topology=variant.topology, settings=planned.trained, folder=folder, meta=RUNS[variant.name].meta
    )
    code = launch(worker_command(spec), variant.topology, node_env=lambda _node: ALLOCATOR_ENV)
    if code != 0:
        raise RuntimeError(f"bench: run {variant.name!r} failed with exit code {code}; its ranks' output is above")
    rows = []
    for rank, result in enumerate(rank_results(folder, variant.topology.world_size)):
        (run,) = result["runs"]
        stage = variant.plan.stages[run["stage"]]
        param_bytes = sum(profile.layers[i].param_bytes for i in stage.layers)
        rows.append(
            MemoryRow(
                variant=variant.name,
                rank=rank,
                stage=stage.index,
                layers=f"{stage.layers[0]}-{stage.layers[-1]}",
                stage_state_gb=ADAMW_STATE_MULTIPLIER * param_bytes / GB,
                estimate_gb=stage.memory_gb,
                baseline_gb=result["baseline_rss_bytes"] / GB,
                peak_gb=result["peak_rss_bytes"] / GB,
                code_gb=(result["end_file_rss_bytes"] - result["baseline_file_rss_bytes"]) / GB,
                checkpointing=str(stage.checkpointing),
                losses=tuple(run["loss"]),
            )
        )
    return rows


def describe_job(planned: MemoryVariant) -> str:
    """The model, its weights, batch and steps of one job."""
    trained, model = planned.trained, planned.trained.model
    return (
        f"GPT {model.n_layers}x{model.d_model} (heads {model.n_heads}, seq {model.seq_len}), "
        f"{planned.profile.param_bytes / GB:.3f} GB of fp32 weights, AdamW, global batch {trained.global_batch} "
        f"sequences, {trained.steps} steps"
    )


def plan_line(planned: MemoryVariant) -> str:
    v, p = planned.variant, planned.variant.plan
    return (
        f"- {v.name}: {v.label}; pp={p.pp} x dp={p.dp}, {p.microbatches} micro-batches of {p.microbatch_size}, "
        f"layers {p.layers_per_stage()}, {p.schedule}, sharding {p.sharding}, activation checkpointing "
        f"{p.stages[0].checkpointing}"
    )


def markdown(rows: list[MemoryRow], planned: list[MemoryVariant], context: dict) -> str:
    lines = [
        f"# holmes-lightning memory benchmark: {context['bench']}",
        "",
        f"On {context['cluster']}, one process per rank on loopback, glibc's mmap threshold fixed at 64 KB. Per rank: "
        f"resident memory just before the model is built (baseline) and at its peak; code = the libraries' code "
        f"paged in after the baseline (file-mapped resident memory, end of the run less baseline); model = peak - "
        f"baseline - code, what the planner estimates. Stage state = the stage's weights + gradients + AdamW states "
        f"(4 x its parameter bytes, whole, not per shard).",
    ]
    weights = [p for p in planned if p.name not in AC_VARIANTS]
    activations = [p for p in planned if p.name in AC_VARIANTS]
    if weights:
        lines += weights_section([r for r in rows if not r.activations_job], weights)
    if activations:
        lines += activations_section([r for r in rows if r.activations_job], activations)
    return "\n".join(lines) + "\n"


def weights_section(rows: list[MemoryRow], planned: list[MemoryVariant]) -> list[str]:
    lines = ["", "## Weights: built on meta or whole, sharded or replicated", "", f"{describe_job(planned[0])}.", ""]
    lines += [plan_line(p) for p in planned]
    lines += [
        "",
        "| run | rank | stage (layers) | stage state GB | estimate GB | baseline GB | peak GB | code GB | model GB "
        "| model / stage state | estimate / model | targets |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        verdict = ("met" if r.meets_targets else "NOT met") if r.meta else "n/a (before)"
        lines.append(
            f"| {r.variant} | {r.rank} | {r.stage} ({r.layers}) | {r.stage_state_gb:.3f} | {r.estimate_gb:.3f} | "
            f"{r.baseline_gb:.3f} | {r.peak_gb:.3f} | {r.code_gb:.3f} | {r.model_gb:.3f} | {r.state_ratio:.2f} | "
            f"{1 + r.estimate_error:.2f} | {verdict} |"
        )
    meta_rows = [r for r in rows if r.meta]
    met = sum(r.meets_targets for r in meta_rows)
    lines += [
        "",
        f"Targets (meta-built runs, every rank): model <= {STATE_TARGET} x stage state, estimate within "
        f"{ESTIMATE_TOLERANCE:.0%} of model: {met}/{len(meta_rows)} ranks -> "
        f"{'met' if met == len(meta_rows) else 'NOT met'}.",
    ]
    return lines


def activations_section(rows: list[MemoryRow], planned: list[MemoryVariant]) -> list[str]:
    lines = ["", "## Activation checkpointing: off, full, selective", "", f"{describe_job(planned[0])}.", ""]
    lines += [plan_line(p) for p in planned]
    lines += [
        "",
        "| run | rank | stage (layers) | AC | stage state GB | estimate GB | baseline GB | peak GB | code GB "
        "| model GB | estimate / model | target |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.variant} | {r.rank} | {r.stage} ({r.layers}) | {r.checkpointing} | {r.stage_state_gb:.3f} | "
            f"{r.estimate_gb:.3f} | {r.baseline_gb:.3f} | {r.peak_gb:.3f} | {r.code_gb:.3f} | {r.model_gb:.3f} | "
            f"{1 + r.estimate_error:.2f} | {'met' if r.meets_targets else 'NOT met'} |"
        )
    met = sum(r.meets_targets for r in rows)
    lines += [
        "",
        f"Target (every rank of every mode): estimate within {AC_TOLERANCE:.0%} of model: {met}/{len(rows)} ranks -> "
        f"{'met' if met == len(rows) else 'NOT met'}.",
        *against_off(rows),
    ]
    return lines


def against_off(rows: list[MemoryRow]) -> list[str]:
    """Per mode next to off: model memory per rank (measured and estimated), and the losses per step."""
    off = {r.rank: r for r in rows if r.checkpointing == "off"}
    lines = []
    for mode in ("full", "selective"):
        runs = [r for r in rows if r.checkpointing == mode and r.rank in off]
        if not runs:
            continue
        measured = ", ".join(f"{r.model_gb / off[r.rank].model_gb:.2f}" for r in runs)
        estimated = ", ".join(f"{r.estimate_gb / off[r.rank].estimate_gb:.2f}" for r in runs)
        pairs = [(a, b) for r in runs for a, b in zip(r.losses, off[r.rank].losses, strict=True)]
        gap = max((abs(a - b) for a, b in pairs), default=float("nan"))  # nan: no losses recorded
        losses = ", ".join(f"{loss:.4f}" for loss in runs[0].losses)
        lines.append(
            f"- {mode} / off, model memory per rank: measured {measured}; estimated {estimated}. Losses per step "
            f"{losses}; largest difference to off's on any rank: {gap:.1e}."
        )
    return ["", *lines] if lines else []


def draw(path: Path, rows: list[MemoryRow]) -> None:
    """The weights job's ranks (measured peak over the baseline, the estimate, the target) and the activations job's
    (per rank and checkpointing mode: measured model memory and the estimate), side by side."""
    panels = [
        (draw_weights, [r for r in rows if not r.activations_job]),
        (draw_modes, [r for r in rows if r.activations_job]),
    ]
    panels = [(drawer, chosen) for drawer, chosen in panels if chosen]
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 5), squeeze=False)
    for ax, (drawer, chosen) in zip(axes[0], panels, strict=True):
        drawer(ax, chosen)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_weights(ax: plt.Axes, rows: list[MemoryRow]) -> None:
    """Per rank: measured peak (baseline, library code and model stacked), the estimate, and the target line."""
    positions = range(len(rows))
    width = 0.38
    left = [p - width / 2 for p in positions]
    floors = [r.baseline_gb + r.code_gb for r in rows]
    ax.bar(left, [r.baseline_gb for r in rows], width, color="lightgray", label="baseline (before the model)")
    ax.bar(left, [r.code_gb for r in rows], width, bottom=[r.baseline_gb for r in rows], color="dimgray", label="code")
    ax.bar(left, [r.model_gb for r in rows], width, bottom=floors, label="model (measured)")
    estimates = [floor + r.estimate_gb for floor, r in zip(floors, rows, strict=True)]
    ax.bar([p + width / 2 for p in positions], estimates, width, label="baseline + code + planner's estimate")
    for position, floor, r in zip(positions, floors, rows, strict=True):
        target = floor + STATE_TARGET * r.stage_state_gb
        ax.hlines(target, position - width, position + width, colors="black", linestyles="dashed")
    ax.plot([], [], "k--", label=f"baseline + code + {STATE_TARGET} x stage state")
    ax.set_xticks(list(positions), [f"{r.variant.removeprefix('memory_')}\nrank {r.rank}" for r in rows], fontsize=8)
    ax.set_ylabel("GB resident")
    ax.set_title("Weights job: peak memory per rank")
    ax.legend(fontsize=8, loc="lower right")


def draw_modes(ax: plt.Axes, rows: list[MemoryRow]) -> None:
    """Per rank, per checkpointing mode: model memory measured (solid) and estimated (hatched), estimate / measured
    written above."""
    modes = [m for m in MODE_COLORS if any(r.checkpointing == m for r in rows)]
    ranks = sorted({r.rank for r in rows})
    width = 0.4
    ticks, labels = [], []
    for r in rows:
        position = ranks.index(r.rank) * (len(modes) + 1) + modes.index(r.checkpointing)
        color = MODE_COLORS[r.checkpointing]
        ax.bar(position - width / 2, r.model_gb, width, color=color)
        ax.bar(position + width / 2, r.estimate_gb, width, color="white", edgecolor=color, hatch="//")
        ax.text(
            position,
            max(r.model_gb, r.estimate_gb),
            f"{1 + r.estimate_error:.2f}",
            ha="center",
            va="bottom",
            fontsize=7,
        )
        ticks.append(position)
        labels.append(f"{r.checkpointing}\nrank {r.rank}")
    for mode in modes:
        ax.bar(0, 0, color=MODE_COLORS[mode], label=f"AC {mode}: measured")
    ax.bar(0, 0, color="white", edgecolor="gray", hatch="//", label="planner's estimate")
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_ylim(0, 1.2 * max(max(r.model_gb, r.estimate_gb) for r in rows))  # room for the legend
    ax.set_ylabel("model GB (peak - baseline - code)")
    ax.set_title("Activation checkpointing: model memory per rank (estimate / measured above)")
    ax.legend(fontsize=8, loc="upper right", ncols=2)


def run_memory_bench(
    hybrid: Topology, settings: BenchSettings, requested: StrategyConfig, out_dir: Path
) -> tuple[list[MemoryRow], str]:
    """Plan and run every memory variant, write memory.md, memory.json and memory.png; returns the rows and table."""
    planned = plan_memory_variants(hybrid, settings, requested)
    rows = []
    for index, run in enumerate(planned, 1):
        print(f"bench [{index}/{len(planned)}] {run.name}: {run.variant.label} on {hybrid.name}", flush=True)
        rows += measure(run, out_dir / run.name)
    context = {"bench": settings.name, "cluster": hybrid.name}
    table = markdown(rows, planned, context)
    (out_dir / "memory.md").write_text(table)
    data = {
        **context,
        "jobs": {p.name: describe_job(p) for p in planned},
        "rows": [
            {
                **asdict(r),
                "model_gb": r.model_gb,
                "estimate_over_model": 1 + r.estimate_error,
                "meets_targets": r.meets_targets if r.meta else None,
            }
            for r in rows
        ],
        "plans": {p.name: json.loads(p.variant.plan.to_json()) for p in planned},
    }
    (out_dir / "memory.json").write_text(json.dumps(data, indent=1))
    draw(out_dir / "memory.png", rows)
    return rows, table
