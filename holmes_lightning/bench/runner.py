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
from holmes_lightning.bench.variants import Hardware, Variant, plan_variants
from holmes_lightning.cli.config import LabConfig
from holmes_lightning.cli.launch import start_ranks
from holmes_lightning.planner import MachineCosts, ModelProfile, PlanOptions
from holmes_lightning.topology import Topology


@dataclass(frozen=True)
class RunResult:
    """One variant's measured steps (per step the slowest rank; warm-up excluded) and its prediction; `foreign_load`:
    the share of the machine's cores other work took during its launch."""

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
    """One launch of the lab: per run, every rank's step seconds; and the share of the machine's cores that other
    work took meanwhile (`bench.load`)."""

    steps: dict[str, list[list[float]]]
    foreign_load: float


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
    steps = {run.name: [rank["runs"][i]["step_s"] for rank in ranks] for i, run in enumerate(runs)}
    return Launch(steps, foreign)


def measured_steps(per_rank: Sequence[Sequence[float]], warmup_steps: int) -> list[float]:
    """Per step after the warm-up, the slowest rank's seconds (a step ends when every rank has ended it)."""
    return [max(step) for step in zip(*per_rank, strict=True)][warmup_steps:]


def summarize(
    variant: Variant, per_rank: list[list[float]], settings: BenchSettings, profile: ModelProfile, foreign_load: float
) -> RunResult:
    slowest = measured_steps(per_rank, settings.warmup_steps)
    median = statistics.median(slowest)
    tokens = settings.global_batch * BenchModel.trained_by(settings).seq_len
    world = variant.topology.world_size
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
        foreign_load=foreign_load,
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
    run's context for the report."""
    profile, calibration = measured
    hardware = Hardware.derive(hybrid, settings, calibration)
    variants = plan_variants(hardware, profile, settings, requested)
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
        per_rank = launched.steps[variant.name]
        results.append(
            summarize(variant, per_rank, settings=settings, profile=profile, foreign_load=launched.foreign_load)
        )
        print(
            f"bench [{index}/{len(variants)}] {variant.name}: median step {results[-1].median_s:.3f} s "
            f"(predicted {results[-1].predicted_s:.3f} s), {time.monotonic() - start:.0f} s wall, other work took "
            f"{results[-1].foreign_load:.0%} of the cores",
            flush=True,
        )
    context = {"calibration": calibration, "profile": profile, "variants": variants}
    return results, context
