"""`python -m holmes_lightning.bench bench=regret`: every configuration of a small job, measured, against the planner's
choice.

For each cluster named in `bench.variants` (two_cluster_mixed and three_cluster): every feasible Holmes configuration
of the bench model at its global batch, i.e. every DP size of Holmes' layouts (the pipeline degree follows), every
micro-batch count, partition `auto` and `uniform`, and sharding `fsdp` and `none` (`none` alone with one rank per
stage, where there is nothing to shard), each planned by the calibrated cost model in the best order of the NIC
groups. Configurations that come out as the same plan run once. All of them run in one launch of the lab per cluster,
one Trainer after another in the same ranks (start-up is paid once), in a fixed shuffled order so that a drift of the
machine's speed does not line up with the predictions. Links run at the lab's default bandwidth scale (this CPU
against the cluster's devices, `lab.scale`) unless `bench.bandwidth_scale` is set.

Reported per cluster: each configuration's predicted and measured step, where the planner's free choice ranks by
measured step and its regret (its measured step / the best measured - 1; target <= 5%), and Spearman's rank
correlation of predicted against measured steps (target >= 0.9).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import matplotlib

from holmes_lightning.bench.calibrate import LabCalibration, lab_topology
from holmes_lightning.bench.config import BenchSettings
from holmes_lightning.bench.model import BenchModel
from holmes_lightning.bench.runner import launch_runs, measure_model, measured_steps
from holmes_lightning.bench.variants import Variant, free_choice, on_gloo, run_key
from holmes_lightning.cli.config import StrategyConfig
from holmes_lightning.planner import (
    BatchSettings,
    MachineCosts,
    ModelProfile,
    PartitionRule,
    Plan,
    PlanError,
    PlanOptions,
    Schedule,
    Sharding,
    best_plan,
)
from holmes_lightning.planner.layout import dp_degrees
from holmes_lightning.topology import Topology

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REGRET_TARGET = 0.05
SPEARMAN_TARGET = 0.9
PARTITIONS = tuple(PartitionRule)
CHOICE = "planner's choice"


@dataclass(frozen=True)
class Row:
    """One configuration of one cluster: its plan, predicted and measured (median, slowest rank per step) step."""

    cluster: str
    name: str
    layout: str
    chosen: bool
    predicted_s: float
    measured_s: float
    step_s: tuple[float, ...]


@dataclass(frozen=True)
class ClusterRegret:
    """Every configuration of one cluster and how the planner's choice fares among them by measurement."""

    cluster: str
    rows: tuple[Row, ...]
    calibration: LabCalibration
    foreign_load: float
    wall_s: float = 0.0

    @property
    def choice(self) -> Row:
        return next(row for row in self.rows if row.chosen)

    @property
    def best(self) -> Row:
        return min(self.rows, key=lambda row: row.measured_s)

    @property
    def regret(self) -> float:
        return self.choice.measured_s / self.best.measured_s - 1

    @property
    def choice_rank(self) -> int:
        """1 = the fastest measured configuration."""
        return 1 + sum(row.measured_s < self.choice.measured_s for row in self.rows)

    @property
    def spearman(self) -> float:
        return spearman([row.predicted_s for row in self.rows], [row.measured_s for row in self.rows])

    @property
    def met(self) -> bool:
        return self.regret <= REGRET_TARGET and self.spearman >= SPEARMAN_TARGET


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's of the values' ranks (ties share their average rank)."""
    return statistics.correlation(ranks(xs), ranks(ys))


def ranks(values: Sequence[float]) -> list[float]:
    """Each value's place in ascending order, from 1; tied values share the average of their places."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    places = [0.0] * len(values)
    start = 0
    while start < len(order):
        stop = start
        while stop + 1 < len(order) and values[order[stop + 1]] == values[order[start]]:
            stop += 1
        for position in range(start, stop + 1):
            places[order[position]] = (start + stop) / 2 + 1
        start = stop + 1
    return places


def describe(plan_: Plan) -> str:
    return (
        f"{plan_.schedule.value}, pp={plan_.pp} x dp={plan_.dp}, {plan_.microbatches} mb, "
        f"layers {plan_.layers_per_stage()}, {plan_.sharding}"
    )


def configurations(
    lab: Topology,
    profile: ModelProfile,
    *,
    global_batch: int,
    options: PlanOptions,
    costs: MachineCosts,
    schedules: Sequence[Schedule] | None = None,
) -> tuple[dict[str, Plan], str]:
    """Every feasible configuration's plan by name (one name per distinct plan), and the name of the planner's free
    choice among them; with `schedules`, those of each schedule, and the free choice plans `schedule=auto`."""
    found: dict[tuple, tuple[str, Plan]] = {}
    for schedule in schedules or (options.schedule,):
        _add_configurations(found, lab, profile, global_batch, replace(options, schedule=schedule), costs)
    free = free_choice(options) if schedules is None else replace(free_choice(options), schedule=Schedule.auto)
    chosen = best_plan(lab, profile, BatchSettings(global_batch), options=free, costs=costs)
    if run_key(chosen) not in found:
        found[run_key(chosen)] = (CHOICE, chosen)
    return {name: planned for name, planned in found.values()}, found[run_key(chosen)][0]


def _add_configurations(
    found: dict[tuple, tuple[str, Plan]],
    lab: Topology,
    profile: ModelProfile,
    global_batch: int,
    options: PlanOptions,
    costs: MachineCosts,
) -> None:
    """Every feasible configuration of `options`' schedule, by what it runs (`run_key`): (name, plan)."""
    for dp in dp_degrees(lab):
        per_replica = global_batch // dp if global_batch % dp == 0 else 0
        shardings = (Sharding.fsdp, Sharding.none) if dp > 1 else (Sharding.none,)
        for microbatches in (m for m in range(1, per_replica + 1) if per_replica % m == 0):
            for sharding in shardings:
                for partition in PARTITIONS:
                    request = replace(options, pp=lab.world_size // dp, dp=dp, partition=partition, sharding=sharding)
                    try:
                        batch = BatchSettings(global_batch, microbatches)
                        planned = best_plan(lab, profile, batch, options=request, costs=costs)
                    except PlanError:  # the schedule needs more micro-batches, or more layers than the model has
                        continue
                    name = f"{planned.schedule.value} pp{planned.pp} dp{dp} mb{microbatches} {sharding} {partition}"
                    key = run_key(planned)
                    if key in found:  # auto found the uniform split: one run, both names
                        name = f"{found[key][0]}={partition}"
                    found[key] = (name, planned)


def measure_cluster(
    cluster: str, *, settings: BenchSettings, requested: StrategyConfig, out_dir: Path
) -> ClusterRegret:
    """Calibrate for this cluster's rank count, plan every configuration, run them all in one launch."""
    topology = Topology.from_config(cluster)
    trained = BenchModel.trained_by(settings)
    profile, calibration = measure_model(topology, settings, trained, assumed=requested.machine_costs())
    lab = lab_topology(topology, calibration.bandwidth_scale, calibration.calibration.device_tflops)
    plans, chosen = configurations(
        lab,
        profile,
        global_batch=settings.global_batch,
        options=on_gloo(requested),
        costs=calibration.calibration.costs,
        schedules=settings.schedules,
    )
    runs = [Variant(name=name, strategy="holmes", topology=topology, plan=planned) for name, planned in plans.items()]
    random.Random(0).shuffle(runs)
    print(f"bench: {cluster}: {len(runs)} configurations in one launch; the planner chooses {chosen!r}", flush=True)
    start = time.monotonic()
    launched = launch_runs(
        runs, topology=topology, settings=settings, scale=calibration.bandwidth_scale, folder=out_dir / cluster
    )
    rows = []
    for run in sorted(runs, key=lambda r: r.plan.prediction.total_s):
        slowest = measured_steps(launched.steps[run.name], settings.warmup_steps)
        rows.append(
            Row(
                cluster=cluster,
                name=run.name,
                layout=describe(run.plan),
                chosen=run.name == chosen,
                predicted_s=run.plan.prediction.total_s,
                measured_s=statistics.median(slowest),
                step_s=tuple(slowest),
            )
        )
    return ClusterRegret(
        cluster=cluster,
        rows=tuple(rows),
        calibration=calibration,
        foreign_load=launched.foreign_load,
        wall_s=time.monotonic() - start,
    )


def markdown(results: list[ClusterRegret], settings: BenchSettings) -> str:
    lines = [
        f"# holmes-lightning benchmark: {settings.name}",
        "",
        f"Model {BenchModel.trained_by(settings).describe()}, global batch "
        f"{settings.global_batch} sequences, {settings.warmup_steps} warm-up + {settings.measured_steps} measured "
        f"steps per configuration, every configuration of a cluster in one launch of the lab. Regret: the planner's "
        f"choice's measured step / the fastest measured - 1 (target <= {REGRET_TARGET:.0%}); Spearman: rank "
        f"correlation of predicted and measured steps (target >= {SPEARMAN_TARGET}).",
        "",
        "| cluster | configurations | planner's choice | its rank by measured step | regret | Spearman | "
        "other work (of the cores) | launch wall s | targets |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for result in results:
        lines.append(
            f"| {result.cluster} | {len(result.rows)} | {result.choice.layout} | {result.choice_rank} | "
            f"{result.regret:.1%} | {result.spearman:.2f} | {result.foreign_load:.0%} | {result.wall_s:.0f} | "
            f"{'met' if result.met else 'NOT met'} |"
        )
    for result in results:
        lines += [
            "",
            f"## {result.cluster}",
            "",
            f"Cost model per rank: {result.calibration.describe()}.",
            "",
            "| configuration | layout | predicted s | measured s (median) | predicted / measured | rank predicted | "
            "rank measured |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        predicted_ranks = ranks([row.predicted_s for row in result.rows])
        measured_ranks = ranks([row.measured_s for row in result.rows])
        for row, by_prediction, by_measurement in zip(result.rows, predicted_ranks, measured_ranks, strict=True):
            name = f"**{row.name} ({CHOICE})**" if row.chosen else row.name
            lines.append(
                f"| {name} | {row.layout} | {row.predicted_s:.3f} | {row.measured_s:.3f} | "
                f"{row.predicted_s / row.measured_s:.2f} | {by_prediction:g} | {by_measurement:g} |"
            )
    return "\n".join(lines) + "\n"


def draw(path: Path, results: list[ClusterRegret]) -> None:
    """Measured against predicted step per configuration, one panel per cluster, the planner's choice marked."""
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 5), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        others = [row for row in result.rows if not row.chosen]
        ax.scatter([r.predicted_s for r in others], [r.measured_s for r in others], label="configuration")
        choice = result.choice
        ax.scatter([choice.predicted_s], [choice.measured_s], marker="*", s=250, color="C3", label=CHOICE)
        low = min(min(r.predicted_s, r.measured_s) for r in result.rows) * 0.9
        high = max(max(r.predicted_s, r.measured_s) for r in result.rows) * 1.1
        ax.plot([low, high], [low, high], color="grey", linewidth=0.8, label="predicted = measured")
        ax.set_xlabel("predicted step, s")
        ax.set_ylabel("measured step (median), s")
        ax.set_title(f"{result.cluster}: regret {result.regret:.1%}, Spearman {result.spearman:.2f}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_regret_bench(settings: BenchSettings, requested: StrategyConfig, out_dir: Path) -> tuple[list, str]:
    """Measure every cluster's configurations; write regret.md, regret.json and regret.png; returns results, table."""
    results = [
        measure_cluster(cluster, settings=settings, requested=requested, out_dir=out_dir)
        for cluster in settings.variants
    ]
    table = markdown(results, settings)
    (out_dir / "regret.md").write_text(table)
    data = {
        "bench": settings.name,
        **BenchModel.trained_by(settings).spec(),
        "global_batch": settings.global_batch,
        "targets": {"regret": REGRET_TARGET, "spearman": SPEARMAN_TARGET},
        "clusters": [
            {
                **asdict(result),
                "calibration": result.calibration.record(),
                "choice": result.choice.name,
                "choice_rank": result.choice_rank,
                "regret": result.regret,
                "spearman": result.spearman,
                "met": result.met,
            }
            for result in results
        ],
    }
    (out_dir / "regret.json").write_text(json.dumps(data, indent=1))
    draw(out_dir / "regret.png", results)
    return results, table
