"""`python -m holmes_lightning.bench [bench=short|full|paper_regime|regret|memory|overhead|elastic] [bench.KEY=...]`.

`bench=short` (default, README) takes about 4 minutes on 2 idle cores, `bench=full` (wider model, larger batch, 8
measured steps) about 8; most of it is process start-up and the flat baselines' slow steps. `bench=paper_regime` (about
12) derives its job from the planner's prediction for the paper's setting (`bench.regime`) and adds Holmes with the
planner's free choice, and Holmes with each schedule of `bench.schedules`, its bubble measured (`bench.bubbles`);
`bench=regret` (about 7) measures every configuration of a small job against the planner's choice (`bench.regret`);
`bench=memory` each rank's peak memory next to the planner's estimate (`bench.memory`); `bench=overhead` HolmesStrategy
on one device against plain Lightning (`bench.overhead`); `bench=elastic` train.py with a rank killed after a
checkpoint: the restart's phases, tokens/s before and after (`bench.elastic`; it plans as train.py does, not by
`strategy` below); `bench=sites` train.py across two sites 1 Gb/s apart: one pipeline, flat DP and DiLoCo against the
homogeneous limit, tokens/s and loss curves (`bench.sites`). Needs root for the lab's namespaces (without, links are not
shaped and it says so). Holmes runs at pp=2 (`strategy.pp`), the degrees the paper compares at; `strategy.pp=null` lets
the planner choose.

Method: the same GPT, byte corpus, global batch and steps for every variant, each started in the lab on its own
emulated network: Holmes on the hybrid cluster, on its homogeneous limit (`Topology.homogeneous()`) and with the
NIC-unaware (Megatron, all-TCP) layout; Lightning's FSDP2 (ModelParallelStrategy) and DDPStrategy over all ranks;
Holmes with auto and with uniform partition on the cluster with one slower NIC. Per step the slowest rank's time
counts; warm-up steps are dropped; the median is reported, with the share of the machine's cores other work took
meanwhile. Each run's plan is the planner's for the cluster the lab emulates (a device per rank at its share of the
cores) and its prediction is for the run here, the ranks sharing the cores (`planner.sharing`): a rank's costs
measured on this machine at the start of the run (`holmes_lightning.measure.calibration`, kept in the run directory
unless HOLMES_CALIBRATION_DIR says otherwise), every link at its configured speed x the bandwidth scale the lab shapes
it with. `bench.trace=true` writes a torch profiler trace per rank of the first measured step. Writes <bench name>.md,
.json and .png into the run directory (outputs/bench/<time>/) and prints the table.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from holmes_lightning.bench.bubbles import draw_schedules
from holmes_lightning.bench.config import BenchJobConfig, register_bench_configs
from holmes_lightning.bench.elastic import run_elastic_bench
from holmes_lightning.bench.memory import run_memory_bench
from holmes_lightning.bench.model import BenchModel
from holmes_lightning.bench.overhead import run_overhead_bench
from holmes_lightning.bench.regime import derive, rederive
from holmes_lightning.bench.regret import run_regret_bench
from holmes_lightning.bench.report import draw, markdown, regime, write_json
from holmes_lightning.bench.runner import measure_model, run_bench
from holmes_lightning.bench.sites import run_sites_bench
from holmes_lightning.cli.config import register_configs
from holmes_lightning.launch.shutdown import skip_exit_collections
from holmes_lightning.measure.calibration import CACHE_ENV
from holmes_lightning.topology import Topology, config_dir

register_configs()
register_bench_configs()


def run(config: BenchJobConfig, out_dir: Path) -> Path:
    """Run the benchmark and write its outputs; returns the Markdown file."""
    settings = config.bench
    hybrid = Topology.from_config(config.cluster)
    if settings.kind == "memory":
        _, table = run_memory_bench(hybrid, settings, config.strategy, out_dir)
        print(table)
        print(f"bench: wrote {out_dir / 'memory.md'}, memory.json and memory.png")
        return out_dir / "memory.md"
    if settings.kind == "overhead":
        _, table = run_overhead_bench(settings, out_dir)
        print(table)
        print(f"bench: wrote {out_dir / 'overhead.md'}, overhead.json and overhead.png")
        return out_dir / "overhead.md"
    if settings.kind == "elastic":
        _, table = run_elastic_bench(settings, out_dir)
        print(table)
        print(f"bench: wrote {out_dir / 'elastic.md'}, elastic.json and elastic.png")
        return out_dir / "elastic.md"
    if settings.kind == "sites":
        _, table = run_sites_bench(settings, out_dir)
        print(table)
        print(f"bench: wrote {out_dir / 'sites.md'}, sites.json and sites.png")
        return out_dir / "sites.md"
    if settings.kind == "regret":
        _, table = run_regret_bench(settings, config.strategy, out_dir)
        print(table)
        print(f"bench: wrote {out_dir / 'regret.md'}, regret.json and regret.png")
        return out_dir / "regret.md"
    derived, assumed = None, config.strategy.machine_costs()
    if settings.match is not None:
        derived = derive(
            hybrid,
            settings,
            requested=config.strategy,
            calibrate=lambda model: measure_model(hybrid, settings, BenchModel(gpt=model), assumed=assumed),
        )
        print(f"bench: {derived.describe()}", flush=True)
        # Measured again, longer: the derivation favours whichever candidate's measurement came out off in its favour
        longer = replace(settings, calibration_seconds=settings.match.calibration_seconds)
        chosen = BenchModel(gpt=derived.choice.model)
        profile, remeasured = measure_model(hybrid, longer, chosen, assumed=assumed, fresh=True)
        derived = rederive(derived, hybrid, settings, requested=config.strategy, measured=(profile, remeasured))
        print(f"bench: derived again on those costs: {derived.describe()}", flush=True)
        settings = derived.settings(settings)
        measured = profile, derived.choice.calibration  # at the derived bandwidth scale
    else:
        measured = measure_model(hybrid, settings, BenchModel.trained_by(settings), assumed=assumed)
    results, context = run_bench(hybrid, settings, requested=config.strategy, out_dir=out_dir, measured=measured)
    context.update(
        bench=settings.name,
        model=BenchModel.trained_by(settings).describe(),
        global_batch=settings.global_batch,
        steps=f"{settings.warmup_steps} warm-up + {settings.measured_steps} measured steps",
        prediction_tolerance=settings.prediction_tolerance,
    )
    check = regime(context["variants"], context["profile"], settings.global_batch, derived=derived)
    table = markdown(results, context, check)
    path = out_dir / f"{settings.name}.md"
    path.write_text(table)
    write_json(path.with_suffix(".json"), results, context=context, check=check)
    draw(path.with_suffix(".png"), results)
    if context["schedule_runs"]:
        draw_schedules(out_dir / f"{settings.name}_schedules.png", context["schedule_runs"])
    print(table)
    chart = f" and {settings.name}_schedules.png" if context["schedule_runs"] else ""
    print(f"bench: wrote {path}, its .json and .png{chart}")
    return path


@hydra.main(version_base=None, config_path=str(config_dir()), config_name="benchmark")
def _hydra_main(cfg: DictConfig) -> None:
    skip_exit_collections()
    try:
        config: BenchJobConfig = OmegaConf.to_object(cfg)
    except ValueError as err:  # ConfigError from the schema's checks
        sys.exit(f"bench: {err}")
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    os.environ.setdefault(CACHE_ENV, str(out_dir / "calibration"))  # measured now, as the runs will be
    run(config, out_dir)


if __name__ == "__main__":
    _hydra_main()
