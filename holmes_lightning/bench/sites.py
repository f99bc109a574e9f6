"""`python -m holmes_lightning.bench bench=sites`: two sites a slow WAN apart, one pipeline across them or DiLoCo.

Method: train.py in the lab (`lab=emulate`, every link at `bench.bandwidth_scale`, or at the scale the lab chooses
from its ranks' share of the cores) on `bench.sites.cluster` (default `two_sites_1gbps`: two clusters of 2 nodes, a
1 Gb/s WAN between them), the recipe's GPT in `bench.model`'s shape, `bench.global_batch` sequences per step over
the job: `homogeneous` (one pipeline, the WAN as fast as the clusters' NICs: the limit, and the synchronous loss) and
`diloco` (a replica per site, an outer step every H of `bench.sites.sync_every` inner steps, each all-reduce
overlapping `bench.sites.overlap_steps` inner steps) train `bench.sites.max_steps` steps, as many tokens each;
`pipeline` (Holmes' one pipeline across the WAN) and `flat_dp` (FSDP2 over every rank, `strategy.layout=flat_fsdp`),
synchronous like the homogeneous run and far slower, train `bench.sites.short_steps` for their tokens/s. Tokens/s:
from the first logged step to the last, by the throughput monitor's samples and seconds (every outer step counted;
DiLoCo's sites added up). Loss: train.py's logged train loss per step (DiLoCo: the sites' mean), the final one the
mean of the last `final_window` steps. Writes sites.md, sites.json and sites.png (loss curves and tokens/s).
"""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib

from holmes_lightning.bench.config import BenchSettings, SitesJob
from holmes_lightning.topology import Topology, config_dir

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@dataclass(frozen=True)
class SitesRun:
    """One variant's run: its tokens/s and train loss per step."""

    variant: str
    tokens_per_s: float
    losses: dict[int, float]
    final_loss: float


def variants(settings: BenchSettings, job: SitesJob) -> dict[str, list[str]]:
    """Each run's name and its train.py overrides beyond the common ones (a later `trainer.max_steps` wins)."""
    nic = max(group.nic.gbps for group in Topology.from_config(job.cluster).spec.clusters)
    runs = {
        "homogeneous": [f"cluster.inter_cluster.gbps={nic}"],
        "pipeline": [f"trainer.max_steps={job.short_steps}"],
        "flat_dp": ["strategy.layout=flat_fsdp", f"trainer.max_steps={job.short_steps}"],
    }
    runs = {name: overrides for name, overrides in runs.items() if name in settings.variants}
    if "diloco" in settings.variants:
        for every in job.sync_every:
            runs[f"diloco_h{every}"] = [
                "strategy.cross_site=diloco",
                f"diloco.sync_every={every}",
                f"diloco.overlap_steps={job.overlap_steps}",
            ]
    return runs


def train_command(settings: BenchSettings, job: SitesJob, folder: Path, overrides: list[str]) -> list[str]:
    script = config_dir().parent / "train.py"
    if not script.is_file():
        raise FileNotFoundError(f"bench=sites runs train.py of a source checkout; {script} is missing")
    model = settings.model
    scale = [] if settings.bandwidth_scale is None else [f"lab.bandwidth_scale={settings.bandwidth_scale}"]
    return [
        sys.executable,
        str(script),
        f"cluster={job.cluster}",
        "lab=emulate",
        *scale,
        *(f"model.{key}={getattr(model, key)}" for key in ("name", "n_layers", "d_model", "n_heads", "seq_len")),
        f"data.global_batch={settings.global_batch}",
        f"data.corpus_bytes={settings.corpus_bytes}",
        f"trainer.max_steps={job.max_steps}",
        "trainer.warmup_steps=2",
        "trainer.limit_val_batches=0",
        "trainer.log_every_n_steps=1",
        "checkpoint.every_n_steps=null",
        f"output_dir={folder}",
        *overrides,
    ]


def measure(name: str, command: list[str], folder: Path, job: SitesJob, timeout_s: float, seq_len: int) -> SitesRun:
    """Run one variant; its output goes to `folder/job.log`."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "job.log"
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"bench sites: {name} failed (exit {done.returncode}); see {log}:\n{log.read_text()[-2000:]}"
        )
    return read_run(name, folder, job, seq_len)


def read_run(name: str, folder: Path, job: SitesJob, seq_len: int) -> SitesRun:
    """A finished variant's tokens/s and losses from the metrics its job logged in `folder`."""
    files = sorted(folder.glob("*/csv/**/metrics.csv"))
    if not files:
        raise RuntimeError(f"bench sites: {name} logged no metrics; see {folder / 'job.log'}")
    per_site = [read_losses(path) for path in files]
    steps = sorted(set.intersection(*(set(losses) for losses in per_site)))
    losses = {step: statistics.fmean(site[step] for site in per_site) for step in steps}
    final = statistics.fmean(losses[step] for step in steps[-job.final_window :])
    return SitesRun(name, sum(tokens_per_s(path, seq_len) for path in files), losses, final)


def tokens_per_s(metrics: Path, seq_len: int) -> float:
    """A job's (a site's) tokens per second from its first logged step to its last, by the throughput monitor's
    samples and seconds so far: every outer step counted, the first step (start-up) not."""
    with metrics.open() as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("train/samples") and row.get("train/time")]
    first, last = rows[0], rows[-1]
    samples = float(last["train/samples"]) - float(first["train/samples"])
    return samples * seq_len / (float(last["train/time"]) - float(first["train/time"]))


def read_losses(path: Path) -> dict[int, float]:
    with path.open() as handle:
        return {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(handle) if row.get("train_loss")}


def markdown(runs: list[SitesRun], settings: BenchSettings, job: SitesJob) -> str:
    limit = next((run for run in runs if run.variant == "homogeneous"), None)
    model = settings.model
    lines = [
        f"# bench=sites: {job.cluster}, GPT {model.n_layers}x{model.d_model} (seq {model.seq_len}), "
        f"{settings.global_batch} sequences per step, {job.max_steps} steps (pipeline, flat_dp: {job.short_steps})",
        "",
        "| run | tokens/s | vs homogeneous | final loss | vs homogeneous (synchronous) |",
        "|---|---:|---:|---:|---:|",
    ]
    for run in runs:
        speed = f"{run.tokens_per_s / limit.tokens_per_s:.2f}" if limit else "-"
        equal_tokens = limit is not None and max(run.losses) == max(limit.losses)
        loss = f"{run.final_loss / limit.final_loss - 1:+.1%}" if equal_tokens else "-"
        lines.append(f"| {run.variant} | {run.tokens_per_s:,.0f} | {speed} | {run.final_loss:.3f} | {loss} |")
    lines += [
        "",
        f"Final loss: the mean of the last {job.final_window} steps' train loss (DiLoCo: the sites' mean), against "
        "the homogeneous run's at as many tokens (synchronous, as the pipeline and flat DP are: the same samples per "
        f"step and optimizer). Links at lab scale {settings.bandwidth_scale}.",
    ]
    return "\n".join(lines) + "\n"


def draw(path: Path, runs: list[SitesRun]) -> None:
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        steps = sorted(run.losses)
        curves.plot(steps, [run.losses[s] for s in steps], label=run.variant, linewidth=1.2)
    curves.set(xlabel="step (same tokens per step for every run)", ylabel="train loss", title="Loss")
    curves.legend()
    bars.bar([run.variant for run in runs], [run.tokens_per_s for run in runs], color="tab:blue")
    bars.set(ylabel="tokens/s", title="Throughput in the lab")
    bars.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_sites_bench(settings: BenchSettings, out_dir: Path) -> tuple[list[SitesRun], str]:
    """Every variant in turn; writes sites.md, sites.json and sites.png."""
    job = settings.sites
    if job is None:
        raise ValueError("bench=sites needs bench.sites (conf/bench/sites.yaml)")
    runs = []
    for name, overrides in variants(settings, job).items():
        short = name in ("pipeline", "flat_dp")
        print(f"bench sites: {name} ({job.short_steps if short else job.max_steps} steps on {job.cluster})", flush=True)
        folder = out_dir / name
        command = train_command(settings, job, folder, overrides)
        runs.append(measure(name, command, folder, job, settings.timeout_s, settings.model.seq_len))
        print(f"bench sites: {name}: {runs[-1].tokens_per_s:,.0f} tokens/s, final loss {runs[-1].final_loss:.3f}")
    table = markdown(runs, settings, job)
    (out_dir / "sites.md").write_text(table)
    data = {"bench": settings.name, "model": asdict(settings.model), "sites": asdict(job)}
    data["runs"] = [asdict(run) for run in runs]
    (out_dir / "sites.json").write_text(json.dumps(data, indent=1))
    draw(out_dir / "sites.png", runs)
    return runs, table
