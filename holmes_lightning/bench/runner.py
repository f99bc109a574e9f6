"""Run every variant in the lab, one after another, and turn their step times into results."""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from holmes_lightning.bench.calibrate import calibrate, profile_gpt
from holmes_lightning.bench.config import BenchSettings
from holmes_lightning.bench.variants import Hardware, Variant, plan_variants
from holmes_lightning.config import LabConfig
from holmes_lightning.launch import start_ranks
from holmes_lightning.planner import ModelProfile, PlanOptions
from holmes_lightning.topology import Topology


@dataclass(frozen=True)
class RunResult:
    """One variant's measured steps (per step the slowest rank; warm-up excluded) and its prediction."""

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


def write_spec(variant: Variant, settings: BenchSettings, folder: Path, meta: bool = False) -> Path:
    """The worker's instructions for one run (`bench.worker`), as `folder/spec.json`."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = {
        "name": variant.name,
        "strategy": variant.strategy,
        "topology": variant.topology.to_dict(),
        "plan": variant.plan.to_json(),
        "model": asdict(settings.model),
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


def run_variant(variant: Variant, settings: BenchSettings, scale: float, folder: Path) -> list[list[float]]:
    """Every rank's step seconds for one variant, run in the lab on the variant's network."""
    command = worker_command(write_spec(variant, settings, folder))
    code = start_ranks(command, variant.topology, LabConfig(mode="emulate", bandwidth_scale=scale))
    if code != 0:
        raise RuntimeError(f"bench: run {variant.name!r} failed with exit code {code}; its ranks' output is above")
    files = [folder / f"rank{rank}.json" for rank in range(variant.topology.world_size)]
    return [json.loads(path.read_text())["step_s"] for path in files]


def summarize(
    variant: Variant, per_rank: list[list[float]], settings: BenchSettings, profile: ModelProfile
) -> RunResult:
    slowest = [max(steps) for steps in zip(*per_rank, strict=True)][settings.warmup_steps :]
    median = statistics.median(slowest)
    tokens = settings.global_batch * settings.model.seq_len
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
    )


def run_bench(
    hybrid: Topology, settings: BenchSettings, requested: PlanOptions, out_dir: Path
) -> tuple[list[RunResult], dict]:
    """Calibrate, plan every variant, run each in the lab; returns the results and the run's context for the report."""
    profile = profile_gpt(settings.model)
    calibration = calibrate(
        hybrid, profile, settings.model, repeats=settings.calibration_repeats, scale=settings.bandwidth_scale
    )
    print(f"bench: calibrated {calibration.describe()}", flush=True)
    hardware = Hardware.derive(hybrid, settings, calibration)
    variants = plan_variants(hardware, profile, settings, requested)
    results = []
    for index, variant in enumerate(variants, 1):
        print(f"bench [{index}/{len(variants)}] {variant.name}: {variant.label} on {variant.topology.name}", flush=True)
        start = time.monotonic()
        per_rank = run_variant(variant, settings, calibration.bandwidth_scale, out_dir / variant.name)
        results.append(summarize(variant, per_rank, settings, profile))
        print(
            f"bench [{index}/{len(variants)}] {variant.name}: median step {results[-1].median_s:.3f} s "
            f"(predicted {results[-1].predicted_s:.3f} s), {time.monotonic() - start:.0f} s wall",
            flush=True,
        )
    context = {"calibration": asdict(calibration), "profile": profile, "variants": variants}
    return results, context
