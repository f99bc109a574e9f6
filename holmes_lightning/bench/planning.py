"""`python -m holmes_lightning.bench.planning [OUT_DIR]`: how long planning takes, 64 to 32,768 GPUs (no processes).

Plans GPT-7.5B (the paper's model; `--model gpt_1_3b` for GPT-1.3B) on clusters of 8-GPU nodes: two clusters
(InfiniBand + RoCE), four alike clusters (2 IB + 2 RoCE: interchangeable, planned once), four clusters that all differ
(NIC speed and TFLOPS: every order of them is searched) and eight distinct sites. Each size is planned `--repeats`
times on one core with each of `--schedules` (default: the default schedule); the table gives the fastest and the
median, and what the search did. `--shapes` (words of their names) and `--gpus` pick fewer. Writes `planning.json`,
`planning.md` and `planning.png` to OUT_DIR (default outputs/bench_planning).

    python -m holmes_lightning.bench.planning out --shapes "8 distinct" --gpus 32768 --model gpt_1_3b --schedules all
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from holmes_lightning.cli.config import ModelConfig  # noqa: E402
from holmes_lightning.planner import BatchSettings, ModelProfile, PlanError, PlanOptions, best_plan  # noqa: E402
from holmes_lightning.planner.options import MODELLED_SCHEDULES, Schedule  # noqa: E402
from holmes_lightning.planner.search import SearchStats  # noqa: E402
from holmes_lightning.topology import Topology  # noqa: E402

GPT_7_5B = ModelConfig(name="gpt_7_5b", n_layers=36, d_model=4096, n_heads=32, seq_len=2048, vocab_size=50304)
GPT_1_3B = ModelConfig(name="gpt_1_3b", n_layers=24, d_model=2048, n_heads=16, seq_len=2048, vocab_size=50304)
MODELS = {model.name: model for model in (GPT_7_5B, GPT_1_3B)}
DEFAULT_SCHEDULE = PlanOptions().schedule
GPU_COUNTS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
SAMPLES_PER_GPU = 2  # global batch = 2 sequences of 2,048 tokens per GPU


@dataclass(frozen=True)
class Shape:
    """A family of clusters: per cluster its NIC kind, NIC Gb/s and device TFLOPS; GPUs split evenly. `pairs`: Gb/s
    of the link between clusters i and j (the rest: the default inter-cluster link); planned from `smallest` GPUs."""

    name: str
    clusters: tuple[tuple[str, float, float], ...]
    pairs: tuple[tuple[int, int, float], ...] = ()
    smallest: int = GPU_COUNTS[0]

    def topology(self, gpus: int) -> Topology:
        nodes = gpus // 8 // len(self.clusters)
        groups = [
            {"name": f"C{i}", "nodes": nodes, "device_tflops": tflops, "nic": {"kind": kind, "gbps": gbps}}
            for i, (kind, gbps, tflops) in enumerate(self.clusters)
        ]
        config = {"name": f"{self.name}_{gpus}", "devices_per_node": 8, "clusters": groups}
        if self.pairs:
            links = [{"clusters": [f"C{i}", f"C{j}"], "gbps": gbps} for i, j, gbps in self.pairs]
            config["inter_cluster"] = {"gbps": 10, "pairs": links}
        return Topology.from_config(config)


EIGHT_SITES = (  # IB, RoCE and Ethernet at two GPU speeds; every pair of sites has its own WAN link, 10-50 Gb/s
    ("infiniband", 400, 312),
    ("infiniband", 200, 312),
    ("roce", 200, 312),
    ("roce", 100, 156),
    ("ethernet", 100, 156),
    ("infiniband", 200, 156),
    ("roce", 200, 156),
    ("ethernet", 25, 312),
)


SHAPES = (
    Shape("2 clusters (IB + RoCE)", (("infiniband", 200, 312), ("roce", 200, 312))),
    Shape("4 alike clusters", (("infiniband", 200, 312), ("roce", 200, 312)) * 2),
    Shape(
        "4 distinct clusters",
        (("infiniband", 400, 312), ("infiniband", 200, 312), ("roce", 200, 156), ("roce", 100, 125)),
    ),
    Shape(
        "8 distinct sites",
        EIGHT_SITES,
        pairs=tuple((i, j, 10.0 * (1 + i * j % 5)) for i in range(8) for j in range(i + 1, 8)),
        smallest=8192,  # below, each site has too few nodes for one stage of DP: pipelines of 16 and more stages
    ),
)


@dataclass(frozen=True)
class Timing:
    shape: str
    gpus: int
    model: str
    schedule: str
    fastest_s: float
    median_s: float
    pp: int
    dp: int
    microbatches: int
    step_s: float
    candidates: int
    searched: int
    simulated: int


def time_planning(
    shape: Shape, gpus: int, repeats: int, model: ModelConfig = GPT_7_5B, schedule: Schedule = DEFAULT_SCHEDULE
) -> Timing:
    """Plan one size `repeats` times (each from scratch) with `schedule` and keep the times and what the search
    did."""
    topology = shape.topology(gpus)
    profile = ModelProfile.from_gpt(model)
    batch = BatchSettings(global_batch=SAMPLES_PER_GPU * gpus)
    options = PlanOptions(schedule=schedule)
    seconds = []
    for _ in range(repeats):
        stats = SearchStats()
        start = time.perf_counter()
        chosen = best_plan(topology, profile, batch, options=options, stats=stats)
        seconds.append(time.perf_counter() - start)
    return Timing(
        shape=shape.name,
        gpus=gpus,
        model=model.name,
        schedule=options.schedule.value,
        fastest_s=min(seconds),
        median_s=statistics.median(seconds),
        pp=chosen.pp,
        dp=chosen.dp,
        microbatches=chosen.microbatches,
        step_s=chosen.prediction.total_s,
        candidates=stats.candidates,
        searched=stats.searched,
        simulated=stats.partitions.simulated,
    )


def table(timings: list[Timing]) -> str:
    lines = [
        "| clusters | GPUs | model | schedule | planning s (fastest) | median | plan pp x dp, micro-batches | "
        "predicted step s | candidates | split searches | splits simulated |",
        "|---|---:|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for t in timings:
        lines.append(
            f"| {t.shape} | {t.gpus:,} | {t.model} | {t.schedule} | {t.fastest_s:.3f} | {t.median_s:.3f} | "
            f"{t.pp} x {t.dp}, {t.microbatches} | "
            f"{t.step_s:.3f} | {t.candidates} | {t.searched} | {t.simulated} |"
        )
    return "\n".join(lines)


def plot(timings: list[Timing], path: Path) -> None:
    figure, axes = plt.subplots(figsize=(7, 4.2), layout="constrained")
    lines = dict.fromkeys((t.shape, t.model, t.schedule) for t in timings)
    for line in lines:
        points = [t for t in timings if (t.shape, t.model, t.schedule) == line]
        label = line[0] if len(lines) == len({key[0] for key in lines}) else ", ".join(line)
        axes.plot([t.gpus for t in points], [t.median_s for t in points], marker="o", label=label)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xticks(GPU_COUNTS, [f"{n:,}" for n in GPU_COUNTS])
    axes.set_xlabel("GPUs (8 per node)")
    axes.set_ylabel("planning time, s (median, one core)")
    models = ", ".join(dict.fromkeys(t.model for t in timings))
    axes.set_title(f"Holmes planner: {models}, best of every layout, split, micro-batch count, sharding", fontsize=9)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> list[Timing]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="outputs/bench_planning", help="directory for JSON and PNG")
    parser.add_argument("--repeats", type=int, default=3, help="plans per size (fastest and median are reported)")
    parser.add_argument("--max-gpus", type=int, default=GPU_COUNTS[-1], help="largest size to plan")
    parser.add_argument("--gpus", type=int, nargs="+", choices=GPU_COUNTS, help="only these sizes")
    parser.add_argument("--shapes", nargs="+", help="only the cluster shapes whose names contain one of these")
    parser.add_argument("--model", choices=sorted(MODELS), default=GPT_7_5B.name, help="the GPT to plan")
    names = [schedule.value for schedule in MODELLED_SCHEDULES]
    parser.add_argument(
        "--schedules", nargs="+", choices=[*names, "all"], help="plan with each of these (all: every one auto chooses)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: plan each size at least once")
    shapes = [shape for shape in SHAPES if not args.shapes or any(word in shape.name for word in args.shapes)]
    if not shapes:
        parser.error(
            f"--shapes {' '.join(args.shapes)}: no shape's name contains them; shapes: {[s.name for s in SHAPES]}"
        )
    chosen = names if args.schedules and "all" in args.schedules else args.schedules
    schedules = [Schedule(name) for name in chosen] if chosen else [DEFAULT_SCHEDULE]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timings = []
    for shape in shapes:
        sizes = args.gpus or GPU_COUNTS
        for gpus in (n for n in GPU_COUNTS if shape.smallest <= n <= args.max_gpus and n in sizes):
            for schedule in schedules:
                label = f"{shape.name:<24}{gpus:>6,} GPUs  {schedule.value:<22}"
                try:
                    timings.append(time_planning(shape, gpus, args.repeats, MODELS[args.model], schedule))
                except PlanError as error:  # this schedule cannot run this job: say why, time the others
                    print(f"{label}refused: {str(error).splitlines()[-1].strip()}", flush=True)
                    continue
                print(f"{label}{timings[-1].median_s:8.3f} s", flush=True)
    if not timings:
        parser.error("nothing planned: every shape's sizes lie outside --gpus / --max-gpus, or each was refused")
    print("\n" + table(timings))
    (out / "planning.json").write_text(json.dumps([asdict(t) for t in timings], indent=2))
    (out / "planning.md").write_text(table(timings) + "\n")
    plot(timings, out / "planning.png")
    print(f"\nwrote {out / 'planning.json'}, {out / 'planning.md'}, {out / 'planning.png'}")
    return timings


if __name__ == "__main__":
    main()
