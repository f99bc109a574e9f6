"""`python -m holmes_lightning.bench bench=memory`: each rank's peak memory next to the planner's per-device estimate.

Method: the recipe's GPT in `bench.model`'s shape (conf/bench/memory.yaml: 16 layers x d_model 1024, 0.81 GB of fp32
weights) trains for the bench's steps with AdamW on the job's cluster (two_cluster_mixed: pp=2 x dp=2), one process
per rank on loopback (link speeds do not change memory). `memory_fsdp` and `memory_replicas` build it under
`trainer.init_module(empty_init=True)`, so that each rank allocates only its stage (FSDP: its shard of it);
`memory_eager` builds it whole on every rank first, as before meta-device support, for comparison.

Each rank reports its resident memory just before the model is built (the baseline: interpreter, torch, Lightning,
the Trainer, the same for any model) and its peak; the model's memory is the difference, which is what the planner
estimates (`CostModel.memory_bytes`). The ranks run with glibc's mmap threshold fixed (`ALLOCATOR_ENV`): by default
glibc raises it as large tensors are freed, after which freed tensors stay resident in its heaps and RSS counts
memory no tensor holds (about 0.5 x a stage's weights here); fixed, RSS follows the tensors, as
`torch.cuda.max_memory_allocated` does on a GPU.

Targets, per rank of the meta-built runs: model memory <= 1.25 x its stage's weights + gradients + AdamW states
(4 x the stage's parameter bytes), and the estimate within 20% of it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import matplotlib
import torch

from holmes_lightning.bench.config import BenchSettings
from holmes_lightning.bench.model import BenchModel
from holmes_lightning.bench.runner import rank_results, worker_command, write_spec
from holmes_lightning.bench.variants import Variant
from holmes_lightning.cli.config import ModelConfig, StrategyConfig
from holmes_lightning.launch.processes import launch
from holmes_lightning.planner import Backend, BatchSettings, ModelProfile, Sharding, best_plan
from holmes_lightning.topology import Topology

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GB = 1e9
STATE_TARGET = 1.25  # peak model memory per rank <= this x its stage's weights + grads + AdamW states
ESTIMATE_TOLERANCE = 0.2
ADAMW_STATE_MULTIPLIER = 4  # fp32 weights, gradients and AdamW's two moments per parameter byte
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # tensors of 64 KB and more: their own pages, returned when freed
SHARDINGS = {"memory_fsdp": Sharding.fsdp, "memory_replicas": Sharding.none, "memory_eager": Sharding.none}


@dataclass(frozen=True)
class MemoryRow:
    """One rank of one run: its stage's state, the planner's estimate and the measured memory, in GB."""

    variant: str
    rank: int
    stage: int
    layers: str
    stage_state_gb: float
    estimate_gb: float
    baseline_gb: float
    peak_gb: float

    @property
    def model_gb(self) -> float:
        return self.peak_gb - self.baseline_gb

    @property
    def meta(self) -> bool:
        return self.variant != "memory_eager"

    @property
    def state_ratio(self) -> float:
        return self.model_gb / self.stage_state_gb

    @property
    def estimate_error(self) -> float:
        return self.estimate_gb / self.model_gb - 1

    @property
    def meets_targets(self) -> bool:
        return self.state_ratio <= STATE_TARGET and abs(self.estimate_error) <= ESTIMATE_TOLERANCE


def meta_profile(model: ModelConfig) -> ModelProfile:
    """The GPT's profile from shapes (FlopCounterMode and saved tensors on the meta device): nothing allocated."""
    with torch.device("meta"):
        return BenchModel(gpt=model).profile()


def plan_memory_variants(
    hybrid: Topology, profile: ModelProfile, settings: BenchSettings, requested: StrategyConfig
) -> list[Variant]:
    batch, costs, plain = BatchSettings(settings.global_batch), requested.machine_costs(), requested.settings()
    options = {name: replace(plain, backend=Backend.gloo, sharding=SHARDINGS[name]) for name in settings.variants}
    return [
        Variant(name, "holmes", hybrid, best_plan(hybrid, profile, batch, options=options[name], costs=costs))
        for name in settings.variants
    ]


def measure(variant: Variant, profile: ModelProfile, settings: BenchSettings, folder: Path) -> list[MemoryRow]:
    """Run one variant's ranks on loopback; a row per rank."""
    spec = write_spec(
        [variant], topology=variant.topology, settings=settings, folder=folder, meta=variant.name != "memory_eager"
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
            )
        )
    return rows


def markdown(rows: list[MemoryRow], variants: list[Variant], context: dict) -> str:
    lines = [
        f"# holmes-lightning memory benchmark: {context['bench']}",
        "",
        f"Model {context['model']} ({context['param_gb']:.2f} GB of fp32 weights), AdamW, global batch "
        f"{context['global_batch']} sequences, {context['steps']}, on {context['cluster']} (one process per rank, "
        f"loopback, glibc's mmap threshold fixed at 64 KB). Per rank: resident memory just before the model is "
        f"built (baseline) and at its peak; model = "
        f"peak - baseline, what the planner estimates. Stage state = the stage's weights + gradients + AdamW states "
        f"(4 x its parameter bytes, whole, not per shard).",
        "",
    ]
    for variant in variants:
        p = variant.plan
        lines.append(
            f"- {variant.name}: {variant.label}; pp={p.pp} x dp={p.dp}, {p.microbatches} micro-batches of "
            f"{p.microbatch_size}, layers {p.layers_per_stage()}, {p.schedule}, sharding {p.sharding}"
        )
    lines += [
        "",
        "| run | rank | stage (layers) | stage state GB | estimate GB | baseline GB | peak GB | model GB "
        "| model / stage state | estimate / model | targets |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        verdict = ("met" if r.meets_targets else "NOT met") if r.meta else "n/a (before)"
        lines.append(
            f"| {r.variant} | {r.rank} | {r.stage} ({r.layers}) | {r.stage_state_gb:.3f} | {r.estimate_gb:.3f} | "
            f"{r.baseline_gb:.3f} | {r.peak_gb:.3f} | {r.model_gb:.3f} | {r.state_ratio:.2f} | "
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
    return "\n".join(lines) + "\n"


def draw(path: Path, rows: list[MemoryRow]) -> None:
    """Per rank: measured peak (baseline and model stacked), the estimate, and the target line."""
    fig, ax = plt.subplots(figsize=(11, 5))
    positions = range(len(rows))
    width = 0.38
    left = [p - width / 2 for p in positions]
    ax.bar(left, [r.baseline_gb for r in rows], width, color="lightgray", label="baseline (before the model)")
    ax.bar(left, [r.model_gb for r in rows], width, bottom=[r.baseline_gb for r in rows], label="model (measured)")
    estimates = [r.baseline_gb + r.estimate_gb for r in rows]
    ax.bar([p + width / 2 for p in positions], estimates, width, label="baseline + planner's estimate")
    for position, r in zip(positions, rows, strict=True):
        target = r.baseline_gb + STATE_TARGET * r.stage_state_gb
        ax.hlines(target, position - width, position + width, colors="black", linestyles="dashed")
    ax.plot([], [], "k--", label=f"baseline + {STATE_TARGET} x stage state")
    ax.set_xticks(list(positions), [f"{r.variant.removeprefix('memory_')}\nrank {r.rank}" for r in rows], fontsize=8)
    ax.set_ylabel("GB resident")
    ax.set_title("Peak memory per rank")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_memory_bench(
    hybrid: Topology, settings: BenchSettings, requested: StrategyConfig, out_dir: Path
) -> tuple[list[MemoryRow], str]:
    """Plan and run every memory variant, write memory.md, memory.json and memory.png; returns the rows and table."""
    profile = meta_profile(settings.model)
    variants = plan_memory_variants(hybrid, profile, settings, requested)
    rows = []
    for index, variant in enumerate(variants, 1):
        print(f"bench [{index}/{len(variants)}] {variant.name}: {variant.label} on {hybrid.name}", flush=True)
        rows += measure(variant, profile, settings, out_dir / variant.name)
    model = settings.model
    context = {
        "bench": settings.name,
        "model": f"GPT {model.n_layers}x{model.d_model} (heads {model.n_heads}, seq {model.seq_len})",
        "param_gb": profile.param_bytes / GB,
        "global_batch": settings.global_batch,
        "steps": f"{settings.steps} steps",
        "cluster": hybrid.name,
    }
    table = markdown(rows, variants, context)
    (out_dir / "memory.md").write_text(table)
    data = {
        **context,
        "rows": [
            {**asdict(r), "model_gb": r.model_gb, "meets_targets": r.meets_targets if r.meta else None} for r in rows
        ],
        "plans": {v.name: json.loads(v.plan.to_json()) for v in variants},
    }
    (out_dir / "memory.json").write_text(json.dumps(data, indent=1))
    draw(out_dir / "memory.png", rows)
    return rows, table
