"""`python -m holmes_lightning.bench bench=overhead`: HolmesStrategy on one device against plain Lightning.

Method: each model (the recipe's GPT in `bench.model`'s shape, and with `bench.hf_model` a transformers causal LM
through `HFCausalLM`, on dict batches) trains on the byte corpus at `bench.global_batch` sequences per step, on one
CPU process of one thread, once under Lightning's default strategy for one device and once under
`HolmesStrategy(pp=1, dp=1)` on a cluster of that one device (calibrating at start, as a user's job does). Each run is
its own process (`python -m holmes_lightning.bench.overhead RUN.json`); the two alternate `bench.repeats` times, so
that whatever else slows the machine meanwhile hits both. Per run: the median of the steps after the warm-up ones
(seconds between consecutive ends of a training step: data loading, forward, backward, optimizer, every hook), and
its start-up (from the Trainer's `setup` to the first step: Holmes profiles, calibrates and plans there). The first
Holmes run calibrates into an empty cache, the later ones read it, so the start-ups show both costs.

Target, per model: Holmes' tokens/s >= `TARGET` x plain Lightning's (the median over the repeats of each pair's
ratio).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
import matplotlib
from lightning.pytorch.callbacks import Callback

from holmes_lightning.bench.config import BenchSettings
from holmes_lightning.bench.model import BenchModel
from holmes_lightning.bench.worker import QUIET_TRAINER, StepTimer
from holmes_lightning.launch.shutdown import skip_exit_collections
from holmes_lightning.measure.calibration import CACHE_ENV
from holmes_lightning.recipes import ByteCorpusDataModule
from holmes_lightning.runtime import HolmesStrategy

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TARGET = 0.98
LABELS = {"plain": "plain Lightning, one device", "holmes": "HolmesStrategy pp=1 x dp=1"}
ONE_DEVICE = {
    "name": "one_device",
    "devices_per_node": 1,
    "clusters": [{"name": "local", "nodes": 1, "nic": {"kind": "ethernet", "gbps": 100}}],
}


@dataclass(frozen=True)
class OverheadRun:
    """One process's run: its median step after warm-up, its start-up, and its tokens/s."""

    model: str
    variant: str
    repeat: int
    step_s: tuple[float, ...]
    median_s: float
    startup_s: float
    tokens_per_s: float


class SetupClock(Callback):
    """When the Trainer's `setup` ran: before the strategy profiles, calibrates and plans."""

    def __init__(self) -> None:
        self.started_at = 0.0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.started_at = time.perf_counter()


def train_once(spec: dict) -> dict:
    """One run in this process: the spec's model for its steps under its variant; its step and start-up seconds."""
    L.seed_everything(spec["seed"], workers=True)
    trained = BenchModel.from_spec(spec)
    holmes = spec["variant"] == "holmes"
    strategy = HolmesStrategy(cluster=ONE_DEVICE, global_batch=spec["global_batch"], pp=1, dp=1) if holmes else "auto"
    timer, setup = StepTimer(spec["variant"], spec["steps"], None, Path()), SetupClock()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=spec["steps"],
        **QUIET_TRAINER,
        callbacks=[timer, setup],
    )
    data = ByteCorpusDataModule(
        seq_len=trained.seq_len,
        global_batch=spec["global_batch"],
        corpus_bytes=spec["corpus_bytes"],
        seed=spec["seed"],
        dict_batches=trained.dict_batches,
    )
    trainer.fit(trained.build(), datamodule=data)
    return {"step_s": timer.seconds, "startup_s": timer.first_step_at - setup.started_at}


def models(settings: BenchSettings) -> dict[str, BenchModel]:
    """The models the bench compares on, by name: the GPT, and the HF model when `bench.hf_model` is set."""
    found = [BenchModel(gpt=settings.model)] + ([BenchModel(hf=settings.hf_model)] if settings.hf_model else [])
    return {model.name: model for model in found}


def run_once(model: str, variant: str, repeat: int, settings: BenchSettings, out_dir: Path) -> OverheadRun:
    """One model's run under one variant in a fresh single-thread process; Holmes' calibration cache lives in
    `out_dir`."""
    folder = out_dir / f"{model}_{variant}_{repeat}"
    folder.mkdir(parents=True, exist_ok=True)
    trained = models(settings)[model]
    spec = {
        **trained.spec(),
        "variant": variant,
        "global_batch": settings.global_batch,
        "steps": settings.steps,
        "corpus_bytes": settings.corpus_bytes,
        "seed": 1234,
    }
    (folder / "spec.json").write_text(json.dumps(spec, indent=1))
    env = {**os.environ, "OMP_NUM_THREADS": "1", CACHE_ENV: str((out_dir / "calibration").resolve())}
    command = [sys.executable, "-m", "holmes_lightning.bench.overhead", str((folder / "spec.json").resolve())]
    subprocess.run(command, env=env, check=True, timeout=settings.timeout_s)
    result = json.loads((folder / "result.json").read_text())
    measured = tuple(result["step_s"][settings.warmup_steps :])
    median = statistics.median(measured)
    return OverheadRun(
        model=model,
        variant=variant,
        repeat=repeat,
        step_s=measured,
        median_s=median,
        startup_s=result["startup_s"],
        tokens_per_s=settings.global_batch * trained.seq_len / median,
    )


def pair_ratios(runs: list[OverheadRun]) -> list[float]:
    """Holmes' tokens/s over plain Lightning's, per repeat (the two runs that ran next to each other), of one model's
    runs."""
    by_repeat: dict[int, dict[str, OverheadRun]] = {}
    for run in runs:
        by_repeat.setdefault(run.repeat, {})[run.variant] = run
    return [pair["holmes"].tokens_per_s / pair["plain"].tokens_per_s for pair in by_repeat.values() if len(pair) == 2]


def by_model(runs: list[OverheadRun]) -> dict[str, list[OverheadRun]]:
    found: dict[str, list[OverheadRun]] = {}
    for run in runs:
        found.setdefault(run.model, []).append(run)
    return found


def markdown(runs: list[OverheadRun], settings: BenchSettings) -> str:
    lines = [
        f"# holmes-lightning overhead benchmark: {settings.name}",
        "",
        f"Batch {settings.global_batch} sequences, {settings.warmup_steps} warm-up + {settings.measured_steps} "
        f"measured steps per run, one CPU thread, one process per run; per model, {LABELS['plain']} and "
        f"{LABELS['holmes']} alternate {settings.repeats} times. Step: median seconds between consecutive ends of a "
        f"training step. Start-up: the Trainer's setup to the first step (Holmes profiles, calibrates and plans "
        f"there; its first run calibrates into an empty cache, later runs read the cache).",
    ]
    for model, mine in by_model(runs).items():
        ratios = pair_ratios(mine)
        ratio = statistics.median(ratios)
        holmes_startups = [r.startup_s for r in mine if r.variant == "holmes"]
        plain_startup = statistics.median(r.startup_s for r in mine if r.variant == "plain")
        lines += [
            "",
            f"## {models(settings)[model].describe()}",
            "",
            "| repeat | run | step s (median) | tokens/s | start-up s |",
            "|---:|---|---:|---:|---:|",
        ]
        lines += [
            f"| {r.repeat} | {LABELS[r.variant]} | {r.median_s:.4f} | {r.tokens_per_s:,.0f} | {r.startup_s:.2f} |"
            for r in mine
        ]
        lines += [
            "",
            f"Holmes / plain tokens/s per repeat: {', '.join(f'{x:.3f}' for x in ratios)}; median {ratio:.3f} "
            f"(target >= {TARGET}: {'met' if ratio >= TARGET else 'NOT met'}).",
            f"Start-up: plain {plain_startup:.2f} s; Holmes {holmes_startups[0]:.2f} s calibrating, "
            f"{statistics.median(holmes_startups[1:] or holmes_startups):.2f} s with the cached calibration.",
        ]
    return "\n".join(lines) + "\n"


def draw(path: Path, runs: list[OverheadRun]) -> None:
    """Per model, tokens/s of every run in the order they ran, Holmes' next to plain Lightning's."""
    groups = by_model(runs)
    fig, axes = plt.subplots(1, len(groups), figsize=(7 * len(groups), 3.5), squeeze=False)
    for ax, (model, mine) in zip(axes[0], groups.items(), strict=True):
        for variant in LABELS:
            bars = [(i, r.tokens_per_s) for i, r in enumerate(mine) if r.variant == variant]
            ax.bar([i for i, _ in bars], [t for _, t in bars], label=LABELS[variant])
        ax.set_xticks(range(len(mine)), [f"{r.variant}\n#{r.repeat}" for r in mine], fontsize=8)
        ax.set_ylabel("tokens/s (median step)")
        ax.set_title(f"{model}: Holmes / plain = {statistics.median(pair_ratios(mine)):.3f}", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_overhead_bench(settings: BenchSettings, out_dir: Path) -> tuple[list[OverheadRun], str]:
    """Per model, alternate plain Lightning and Holmes `settings.repeats` times; write overhead.md, overhead.json,
    overhead.png."""
    runs = []
    for model in models(settings):
        for repeat in range(settings.repeats):
            for variant in LABELS:
                print(f"bench overhead {model} [{repeat + 1}/{settings.repeats}] {LABELS[variant]}", flush=True)
                runs.append(run_once(model, variant, repeat, settings, out_dir))
                print(f"  median step {runs[-1].median_s:.4f} s, start-up {runs[-1].startup_s:.2f} s", flush=True)
    table = markdown(runs, settings)
    (out_dir / "overhead.md").write_text(table)
    ratios = {model: statistics.median(pair_ratios(mine)) for model, mine in by_model(runs).items()}
    data = {
        "bench": settings.name,
        "models": [model.spec() for model in models(settings).values()],
        "global_batch": settings.global_batch,
        "runs": [asdict(r) for r in runs],
        "ratios": ratios,
        "target": TARGET,
        "met": all(ratio >= TARGET for ratio in ratios.values()),
    }
    (out_dir / "overhead.json").write_text(json.dumps(data, indent=1))
    draw(out_dir / "overhead.png", runs)
    return runs, table


if __name__ == "__main__":
    skip_exit_collections()
    spec_path = Path(sys.argv[1])
    result = train_once(json.loads(spec_path.read_text()))
    (spec_path.parent / "result.json").write_text(json.dumps(result))
