"""`python -m holmes_lightning.bench bench=elastic`: a rank dies; how long until the job trains again, and how fast.

Method: per cluster in `bench.variants`, one `train.py` job in the lab (`lab=emulate`, links at `bench.bandwidth_scale`
or at the scale the lab chooses for each launch from its ranks' share of the cores), the recipe's GPT in
`bench.model`'s shape at `bench.global_batch` sequences per step, planned as train.py plans (the planner's free
choice), without validation, with a checkpoint every `bench.elastic.every_n_steps` steps and
`elastic.max_restarts=1`. Once the checkpoint of `bench.elastic.kill_step` is complete, the bench waits
`kill_delay_s` and SIGKILLs one rank (`kill_rank`, default the last). The launcher restarts the job on the nodes left;
their rank 0 plans afresh (calibrating: each layer's timing read from the cache the first launch filled, what the
ranks measure together anew) and every rank resumes from that checkpoint. The job's output is read as it comes
(unbuffered), each line stamped on arrival, and written to `<cluster>/job.log`; the phases from the kill to the end of
the first step after the resume end at the lines `elastic_log.PHASES` names. Tokens/s: per launch, between its
consecutive checkpoints with the saves left out (`elastic_log.speed`), next to the planner's prediction for that
launch's plan. Writes elastic.md, elastic.json and elastic.png.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib

from holmes_lightning.bench.config import BenchSettings, ElasticJob
from holmes_lightning.bench.elastic_log import (
    LaunchPlan,
    Line,
    Phase,
    Save,
    Speed,
    lab_scales,
    phases,
    plans,
    read_saves,
    speed,
    summary,
)
from holmes_lightning.launch.processes import kill_rank
from holmes_lightning.measure.calibration import SECONDS_ENV
from holmes_lightning.runtime.checkpoint import COMPLETE_FILE
from holmes_lightning.topology import Topology, config_dir

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@dataclass(frozen=True)
class LaunchSpeed:
    """One launch's training speed next to the planner's prediction for its plan."""

    launch: str
    ranks: int
    plan: str
    links: str
    measured: Speed
    predicted_tokens_per_s: float

    @property
    def ratio(self) -> float:
        return self.measured.tokens_per_s / self.predicted_tokens_per_s


@dataclass(frozen=True)
class ElasticResult:
    cluster: str
    killed_rank: int
    restart: str  # the launcher's line: the nodes left, those that train
    phases: list[Phase]
    launches: list[LaunchSpeed]
    summary: tuple[float, float] | None  # the run summary's tokens/s and prediction, after the resume

    @property
    def total_s(self) -> float:
        return self.phases[-1].end - self.phases[0].start


def train_command(cluster: str, settings: BenchSettings, job: ElasticJob, folder: Path) -> list[str]:
    """train.py of this source tree on `cluster` in the lab, sized by `settings`, writing into `folder`."""
    script = config_dir().parent / "train.py"
    if not script.is_file():
        raise FileNotFoundError(f"bench=elastic runs train.py of a source checkout; {script} is missing")
    model = settings.model
    scale = [] if settings.bandwidth_scale is None else [f"lab.bandwidth_scale={settings.bandwidth_scale}"]
    return [
        sys.executable,
        str(script),
        f"cluster={cluster}",
        "lab=emulate",
        *scale,
        *(f"model.{key}={getattr(model, key)}" for key in ("name", "n_layers", "d_model", "n_heads", "seq_len")),
        f"data.global_batch={settings.global_batch}",
        f"data.corpus_bytes={settings.corpus_bytes}",
        f"trainer.max_steps={job.max_steps}",
        "trainer.limit_val_batches=0",
        "trainer.log_every_n_steps=1",  # the run summary's throughput window fills within the steps after the resume
        f"checkpoint.every_n_steps={job.every_n_steps}",
        f"checkpoint.keep={job.checkpoints_before + job.checkpoints_after}",
        "elastic.max_restarts=1",
        f"output_dir={folder}",
    ]


def kill_after_checkpoint(folder: Path, job: ElasticJob, rank: int, killed: list[float], timeout_s: float) -> None:
    """Once the kill step's checkpoint is complete and `kill_delay_s` passed, SIGKILL `rank` of the job writing into
    `folder`; appends when (`time.time()`) to `killed`."""
    complete = folder / "checkpoints" / f"step_{job.kill_step:06d}.ckpt" / COMPLETE_FILE
    deadline = time.monotonic() + timeout_s
    while not complete.is_file():
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    time.sleep(job.kill_delay_s)
    now = time.time()
    if kill_rank(rank, str(folder)):
        killed.append(now)


def run_job(
    cluster: str, settings: BenchSettings, *, job: ElasticJob, folder: Path, rank: int
) -> tuple[list[Line], float]:
    """Run the job, kill `rank` after the kill step's checkpoint, and return its stamped output and the kill's time."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", SECONDS_ENV: str(settings.calibration_seconds)}
    process = subprocess.Popen(
        train_command(cluster, settings, job, folder), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    killed: list[float] = []
    killer = threading.Thread(
        target=kill_after_checkpoint, args=(folder, job, rank, killed, settings.timeout_s), daemon=True
    )
    killer.start()
    timer = threading.Timer(settings.timeout_s, process.terminate)  # the launcher stops the ranks and the lab
    timer.start()
    lines, pending = [], b""
    assert process.stdout is not None
    with (folder / "job.log").open("w") as log:
        while chunk := process.stdout.read1(1 << 16):
            at = time.time()
            *complete, pending = (pending + chunk).replace(b"\r", b"\n").split(b"\n")
            for raw in complete:
                lines.append(Line(at, raw.decode(errors="replace")))
                log.write(f"{at:.3f} {lines[-1].text}\n")
                if lines[-1].text.startswith(("holmes", "train.py")):
                    print(f"  {lines[-1].text}", flush=True)
    code = process.wait()
    timer.cancel()
    if code != 0 or not killed:
        what = f"exit code {code}" if code != 0 else f"rank {rank} was never killed"
        raise RuntimeError(f"bench elastic: the job on {cluster} failed ({what}); its output: {folder / 'job.log'}")
    return lines, killed[0]


def measure(cluster: str, settings: BenchSettings, job: ElasticJob, out_dir: Path) -> ElasticResult:
    """One job on `cluster` with a rank killed: its restart's phases, and its speed before and after."""
    world = Topology.from_config(cluster).world_size
    rank = world - 1 if job.kill_rank is None else job.kill_rank
    if rank >= world:
        raise ValueError(f"bench.elastic.kill_rank={rank}: {cluster} has ranks 0-{world - 1}")
    folder = (out_dir / cluster).resolve()
    lines, killed_at = run_job(cluster, settings, job=job, folder=folder, rank=rank)
    tokens_per_step = settings.global_batch * settings.model.seq_len
    return ElasticResult(
        cluster=cluster,
        killed_rank=rank,
        restart=next(line.text for line in lines if " lost; restart " in line.text),
        phases=phases(lines, killed_at),
        launches=launch_speeds(lines, read_saves(folder / "checkpoints"), killed_at, tokens_per_step),
        summary=summary(lines),
    )


def launch_speeds(lines: list[Line], saves: list[Save], killed_at: float, tokens_per_step: int) -> list[LaunchSpeed]:
    """Before the kill and after the resume: each launch's speed between its checkpoints, next to its prediction."""
    sides = {
        "before the kill": [save for save in saves if save.ended < killed_at],
        "after the resume": [save for save in saves if save.started > killed_at],
    }
    scales = _scales(lines)
    return [
        LaunchSpeed(
            launch=name,
            measured=speed(side, tokens_per_step),  # first: it says so when a side has too few checkpoints
            ranks=side[0].world_size,
            plan=plan.layout,
            links=scale or "loopback (no lab)",
            predicted_tokens_per_s=plan.predicted_tokens_per_s,
        )
        for (name, side), plan, scale in zip(sides.items(), _around(plans(lines), killed_at), scales, strict=True)
    ]


def _around(found: list[LaunchPlan], killed_at: float) -> list[LaunchPlan]:
    """The last plan before the kill and the first after it."""
    return [[p for p in found if p.at < killed_at][-1], next(p for p in found if p.at > killed_at)]


def _scales(lines: list[Line]) -> list[str | None]:
    found = lab_scales(lines)
    return [found[0], found[-1]] if len(found) >= 2 else [None, None]  # without the lab, links are not scaled


def markdown(results: list[ElasticResult], settings: BenchSettings, job: ElasticJob) -> str:
    model = settings.model
    lines = [
        f"# holmes-lightning elastic benchmark: {settings.name}",
        "",
        f"train.py in the lab (`lab=emulate`), GPT {model.n_layers}x{model.d_model} (seq {model.seq_len}), "
        f"{settings.global_batch} sequences per step, no validation, a checkpoint every {job.every_n_steps} steps, "
        f"`elastic.max_restarts=1`; {job.kill_delay_s:g} s after the step-{job.kill_step} checkpoint was complete "
        f"the bench SIGKILLed one rank. Phases: from the kill, each to the first output line that marks its end "
        f"(stamped as the bench read it). Tokens/s: between consecutive checkpoints of one launch, saves left out.",
    ]
    for result in results:
        lines += [
            "",
            f"## {result.cluster}: rank {result.killed_rank} killed",
            "",
            f"`{result.restart}`",
            "",
            "| phase | seconds | since the kill | covers | ends at the line |",
            "|---|---:|---:|---|---|",
        ]
        kill = result.phases[0].start
        lines += [
            f"| {p.name} | {p.seconds:.2f} | {p.end - kill:.2f} | {p.covers} | `{p.ended_by[:70]}` |"
            for p in result.phases
        ]
        lines += [
            f"| **kill to first step** | **{result.total_s:.2f}** | | | |",
            "",
            "| launch | ranks | plan | lab links at | steps timed | tokens/s | predicted | measured / predicted |",
            "|---|---:|---|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {s.launch} | {s.ranks} | {s.plan} | {s.links} | {s.measured.steps} | {s.measured.tokens_per_s:,.0f} "
            f"| {s.predicted_tokens_per_s:,.0f} | {s.ratio:.2f} |"
            for s in result.launches
        ]
        before, after = result.launches
        lines += [
            "",
            f"After / before: measured {after.measured.tokens_per_s / before.measured.tokens_per_s:.2f}, predicted "
            f"{after.predicted_tokens_per_s / before.predicted_tokens_per_s:.2f}.",
        ]
        if result.summary is not None:
            measured, predicted = result.summary
            lines.append(
                f"train.py's run summary after the resume (its last window, saves left out): {measured:,.0f} "
                f"tokens/s, predicted {predicted:,.0f} ({measured / predicted:.2f})."
            )
    return "\n".join(lines) + "\n"


def draw(path: Path, results: list[ElasticResult]) -> None:
    """Per cluster: the phases from the kill on one time line, and measured against predicted tokens/s per launch."""
    fig, axes = plt.subplots(len(results), 2, figsize=(13, 2.8 * len(results)), squeeze=False, width_ratios=(3, 1))
    colours = plt.get_cmap("tab10").colors
    for (timeline, speeds), result in zip(axes, results, strict=True):
        kill = result.phases[0].start
        for index, phase in enumerate(result.phases):
            timeline.barh(0, phase.seconds, left=phase.start - kill, color=colours[index], label=phase.name)
            if phase.seconds > 0.04 * result.total_s:
                timeline.text(phase.start - kill + phase.seconds / 2, 0, f"{phase.seconds:.1f} s", ha="center")
        timeline.set_yticks([])
        timeline.set_xlabel("seconds since the kill")
        timeline.set_title(f"{result.cluster}: kill to the first step after the resume, {result.total_s:.1f} s")
        timeline.legend(fontsize=8, ncol=len(result.phases), loc="upper center", bbox_to_anchor=(0.5, -0.35))
        x = range(len(result.launches))
        speeds.bar([i - 0.2 for i in x], [s.measured.tokens_per_s for s in result.launches], 0.4, label="measured")
        speeds.bar([i + 0.2 for i in x], [s.predicted_tokens_per_s for s in result.launches], 0.4, label="predicted")
        speeds.set_xticks(list(x), [f"{s.launch}\n{s.ranks} ranks" for s in result.launches], fontsize=8)
        speeds.set_ylabel("tokens/s")
        speeds.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_elastic_bench(settings: BenchSettings, out_dir: Path) -> tuple[list[ElasticResult], str]:
    """One job per cluster in `settings.variants`, a rank killed in each; writes elastic.md, .json and .png."""
    job = settings.elastic
    if job is None:
        raise ValueError("bench=elastic needs bench.elastic (conf/bench/elastic.yaml)")
    results = []
    for cluster in settings.variants:
        print(
            f"bench elastic: train.py on {cluster}, a rank killed after step {job.kill_step}'s checkpoint", flush=True
        )
        results.append(measure(cluster, settings, job, out_dir))
    table = markdown(results, settings, job)
    (out_dir / "elastic.md").write_text(table)
    data = {
        "bench": settings.name,
        "model": asdict(settings.model),
        "global_batch": settings.global_batch,
        "elastic": asdict(job),
        "results": [
            {
                **asdict(result),
                "phases": [{**asdict(p), "seconds": p.seconds} for p in result.phases],
                "launches": [{**asdict(s), "ratio": s.ratio} for s in result.launches],
                "total_s": result.total_s,
            }
            for result in results
        ],
    }
    (out_dir / "elastic.json").write_text(json.dumps(data, indent=1))
    draw(out_dir / "elastic.png", results)
    return results, table
