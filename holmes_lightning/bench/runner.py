"""Run every variant in the lab, one after another, and turn their step times into results."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from holmes_lightning.bench.calibrate import LabCalibration, calibrate
from holmes_lightning.bench.config import BenchSettings
from holmes_lightning.bench.load import CpuClock
from holmes_lightning.bench.model import BenchModel
from holmes_lightning.bench.variants import Hardware, Variant, plan_schedule_variants, plan_variants
from holmes_lightning.cli.config import LabConfig
from holmes_lightning.cli.launch import start_ranks
from holmes_lightning.planner import MachineCosts, ModelProfile, PlanOptions
from holmes_lightning.topology import Topology


@dataclass(frozen=True)
class RunResult:
    """One variant's measured steps (per step the slowest rank; warm-up excluded) and its prediction; `foreign_load`:
    the share of the machine's cores other work took during its launch. Pipelined, `passes_share` and `waits_share`
    (`pipeline_shares`): what the busiest rank's passes and its waits on its neighbours took of the step, medians."""

    name: str
    label: str
    strategy: str
    network: str
    layout: str
    step_s: tuple[float, ...]
    median_s: float
    tokens_per_s: float
    tflops_per_device: float
    predicted_s: float
    predicted: dict
    foreign_load: float = 0.0
    passes_share: float | None = None
    waits_share: float | None = None


def write_spec(
    runs: Sequence[Variant], topology: Topology, settings: BenchSettings, folder: Path, meta: bool = False
) -> Path:
    """The worker's instructions for one launch of `runs` on `topology` (`bench.worker`), as `folder/spec.json`."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = {
        "runs": [{"name": run.name, "strategy": run.strategy, "plan": run.plan.to_json()} for run in runs],
        "topology": topology.to_dict(),
        **BenchModel.trained_by(settings).spec(),
        "global_batch": settings.global_batch,
        "steps": settings.steps,
        "warmup_steps": settings.warmup_steps,
        "corpus_bytes": settings.corpus_bytes,
        "trace": settings.trace,
        "timeout_s": settings.timeout_s,
        "seed": 1234,
        "meta": meta,
        "out_dir": str(folder.resolve()),
    }
    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    return spec_path


def worker_command(spec_path: Path) -> list[str]:
    return [sys.executable, "-m", "holmes_lightning.bench.worker", str(spec_path.resolve())]


def rank_results(folder: Path, world_size: int) -> list[dict]:
    """What each rank of a finished launch wrote (`bench.worker`), in rank order."""
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(world_size)]


@dataclass(frozen=True)
class Launch:
    """One launch of the lab: per run, every rank's step seconds and, pipelined, the seconds of each step's schedule
    call and of its passes (`bench.worker.PassTimer`); and the share of the machine's cores that other work took
    meanwhile (`bench.load`)."""

    steps: dict[str, list[list[float]]]
    foreign_load: float
    schedule_s: dict[str, list[list[float]]]
    passes_s: dict[str, list[list[float]]]


def launch_runs(
    runs: Sequence[Variant], topology: Topology, settings: BenchSettings, scale: float, folder: Path
) -> Launch:
    """Run `runs` one after another in one launch of the lab on `topology`'s emulated network."""
    command = worker_command(write_spec(runs, topology, settings, folder))
    before = CpuClock.now()
    code = start_ranks(command, topology, LabConfig(mode="emulate", bandwidth_scale=scale))
    foreign = before.foreign_share(CpuClock.now())
    if code != 0:
        names = ", ".join(run.name for run in runs)
        raise RuntimeError(f"bench: launch of {names} failed with exit code {code}; its ranks' output is above")
    ranks = rank_results(folder, topology.world_size)

    def per_run(key: str) -> dict[str, list[list[float]]]:
        return {run.name: [rank["runs"][i][key] for rank in ranks] for i, run in enumerate(runs)}

    return Launch(per_run("step_s"), foreign, per_run("schedule_s"), per_run("passes_s"))


def measured_steps(per_rank: Sequence[Sequence[float]], warmup_steps: int) -> list[float]:
    """Per step after the warm-up, the slowest rank's seconds (a step ends when every rank has ended it)."""
    return [max(step) for step in zip(*per_rank, strict=True)][warmup_steps:]


def pipeline_shares(
    steps: Sequence[Sequence[float]],
    schedule_s: Sequence[Sequence[float]],
    passes_s: Sequence[Sequence[float]],
    warmup_steps: int,
) -> tuple[float, float] | None:
    """Per rank and step its step, schedule-call and passes seconds: the median over the measured steps of the busiest
    rank's passes and of its waits in the schedule call (the call less its passes), each over the slowest rank's step
    (None: not pipelined)."""
    if not any(schedule_s):
        return None
    passes, waits = [], []
    for i in range(warmup_steps, len(steps[0])):
        step = max(rank[i] for rank in steps)
        busiest = max(range(len(passes_s)), key=lambda rank: passes_s[rank][i])
        passes.append(passes_s[busiest][i] / step)
        waits.append((schedule_s[busiest][i] - passes_s[busiest][i]) / step)
    return statistics.median(passes), statistics.median(waits)


def summarize(variant: Variant, launched: Launch, settings: BenchSettings, profile: ModelProfile) -> RunResult:
    per_rank = launched.steps[variant.name]
    slowest = measured_steps(per_rank, settings.warmup_steps)
    median = statistics.median(slowest)
    tokens = settings.global_batch * BenchModel.trained_by(settings).seq_len
    world = variant.topology.world_size
    shares = pipeline_shares(
        per_rank, launched.schedule_s[variant.name], launched.passes_s[variant.name], settings.warmup_steps
    )
    plan = variant.plan
    layout = f"pp={plan.pp} x dp={plan.dp}, {plan.microbatches} mb, layers {plan.layers_per_stage()}, {plan.sharding}"
    return RunResult(
        name=variant.name,
        label=variant.label,
        strategy=variant.strategy,
        network=variant.topology.name,
        layout=layout if variant.strategy == "holmes" else f"dp={world} ({variant.strategy})",
        step_s=tuple(slowest),
        median_s=median,
        tokens_per_s=tokens / median,
        tflops_per_device=profile.flops_per_sample * settings.global_batch / median / world / 1e12,
        predicted_s=plan.prediction.total_s,
        predicted=asdict(plan.prediction),
        foreign_load=launched.foreign_load,
        passes_share=None if shares is None else shares[0],
        waits_share=None if shares is None else shares[1],
    )


def measure_model(
    hybrid: Topology, settings: BenchSettings, model: BenchModel, *, assumed: MachineCosts, fresh: bool = False
) -> tuple[ModelProfile, LabCalibration]:
    """`model`'s profile and a lab rank's costs for it, measured here (at `settings.bandwidth_scale`, or this CPU's;
    `assumed`: what is not measured); `fresh`: measured again even if cached."""
    profile = model.profile()
    calibration = calibrate(
        hybrid,
        profile,
        model,
        seconds=settings.calibration_seconds,
        scale=settings.bandwidth_scale,
        assumed=assumed,
        fresh=fresh,
    )
    print(f"bench: calibrated {model.name}: {calibration.describe()}", flush=True)
    return profile, calibration


def run_bench(
    hybrid: Topology,
    settings: BenchSettings,
    *,
    requested: PlanOptions,
    out_dir: Path,
    measured: tuple[ModelProfile, LabCalibration],
) -> tuple[list[RunResult], dict]:
    """Plan every variant for the `measured` model and rank costs, run each in the lab; returns the results and the
    run's context for the report: with `settings.schedules` also Holmes' run per schedule (`schedule_runs`) and why
    the planner refused a schedule (`refused_schedules`)."""
    profile, calibration = measured
    hardware = Hardware.derive(hybrid, settings, calibration)
    variants = plan_variants(hardware, profile, settings, requested)
    scheduled, refused = plan_schedule_variants(hardware, profile, settings, requested)
    results = run_variants(variants, settings, calibration, profile, out_dir)
    context = {
        "calibration": calibration,
        "profile": profile,
        "variants": variants,
        "schedule_runs": run_variants(scheduled, settings, calibration, profile, out_dir),
        "refused_schedules": refused,
    }
    return results, context


def run_variants(
    variants: Sequence[Variant],
    settings: BenchSettings,
    calibration: LabCalibration,
    profile: ModelProfile,
    out_dir: Path,
) -> list[RunResult]:
    """Run each variant in its own launch of the lab, one after another, and summarize its steps."""
    results = []
    for index, variant in enumerate(variants, 1):
        print(f"bench [{index}/{len(variants)}] {variant.name}: {variant.label} on {variant.topology.name}", flush=True)
        start = time.monotonic()
        launched = launch_runs(
            [variant],
            topology=variant.topology,
            settings=settings,
            scale=calibration.bandwidth_scale,
            folder=out_dir / variant.name,
        )
        results.append(summarize(variant, launched, settings=settings, profile=profile))
        print(
            f"bench [{index}/{len(variants)}] {variant.name}: median step {results[-1].median_s:.3f} s "
            f"(predicted {results[-1].predicted_s:.3f} s), {time.monotonic() - start:.0f} s wall, other work took "
            f"{results[-1].foreign_load:.0%} of the cores",
            flush=True,
        )
    return results
