"""One rank of one launch of the bench: `python -m holmes_lightning.bench.worker SPEC.json`, started by the lab.

For each of the spec's runs in turn (`spec["runs"]`: name, strategy and, for Holmes, the plan), trains the spec's
model (`bench.model.BenchModel`: the recipe's GPT, or an HF causal LM on dict batches) on the byte corpus for the
given steps under a fresh Trainer; writes this rank's step times per run (seconds between consecutive ends of a
training step), losses and, pipelined, the seconds of each step's schedule call and of its passes (`PassTimer`) to
`rank<N>.json` in the spec's folder, with its resident memory just before the first model
is built (`baseline_rss_bytes`) and at its peak from then on, and the part of it mapped from files (libraries' code)
then and at the end. `spec["meta"]`: build the model under `trainer.init_module(empty_init=True)` (HolmesStrategy then
allocates only this rank's stage).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy

from holmes_lightning.bench.model import BenchModel
from holmes_lightning.launch.shutdown import skip_exit_collections
from holmes_lightning.measure import (
    file_resident_bytes,
    peak_resident_bytes,
    resident_bytes,
    restart_peak_resident,
)
from holmes_lightning.planner import Plan
from holmes_lightning.recipes import ByteCorpusDataModule
from holmes_lightning.runtime import HolmesStrategy
from holmes_lightning.runtime.environment import default_environment
from holmes_lightning.runtime.pipeline import BuiltSchedule
from holmes_lightning.topology import Topology


class StepTimer(Callback):
    """Wall time and loss of every training step on this rank; rank 0 prints each as it ends, so long runs show
    progress."""

    def __init__(self, label: str, steps: int, trace_step: int | None, trace_path: Path) -> None:
        self.label = label
        self.steps = steps
        self.trace_step = trace_step
        self.trace_path = trace_path
        self.seconds: list[float] = []
        self.losses: list[float] = []
        self.first_step_at = 0.0
        self._last = 0.0
        self._profiler: torch.profiler.profile | None = None

    def on_train_batch_start(self, trainer: L.Trainer, _module: L.LightningModule, _batch: Any, index: int) -> None:
        if index == 0:
            self._last = self.first_step_at = time.perf_counter()
        if index == self.trace_step:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profiler.start()

    def on_train_batch_end(self, trainer: L.Trainer, _module: L.LightningModule, outputs: Any, *_args: Any) -> None:
        now = time.perf_counter()
        self.seconds.append(now - self._last)
        self._last = now
        self.losses.append(float(outputs["loss"] if isinstance(outputs, Mapping) else outputs))
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler.export_chrome_trace(str(self.trace_path))
            self._profiler = None
        if trainer.is_global_zero:
            print(f"  {self.label}: step {len(self.seconds)}/{self.steps} {self.seconds[-1]:.3f} s", flush=True)


class PassTimer(Callback):
    """Per training step of a pipelined HolmesStrategy on this rank: the seconds in its schedule's call (`schedule_s`)
    and, of those, in its stages' passes (`passes_s`: forward, backward and weight-gradient chunks); the rest of the
    call is what the rank waited for its neighbours, bubble and transfers. Nothing for a run without a pipeline."""

    def __init__(self) -> None:
        self.schedule_s: list[float] = []
        self.passes_s: list[float] = []
        self._in_schedule = self._in_passes = 0.0

    def on_train_start(self, trainer: L.Trainer, _module: L.LightningModule) -> None:
        pipeline = getattr(trainer.strategy, "pipeline", None)
        if pipeline is not None:
            pipeline.on_schedule_built.append(self._time)

    def _time(self, schedule: BuiltSchedule) -> None:
        """Time a training schedule's calls and its stages' passes (the pipeline builds one per batch shape)."""
        if not schedule.trains:
            return
        schedule.runner.step = self._timed(schedule.runner.step, "_in_schedule")
        for stage in schedule.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._timed(getattr(stage, name), "_in_passes"))

    def _timed(self, call: Callable[..., Any], total: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                setattr(self, total, getattr(self, total) + time.perf_counter() - start)

        return timed

    def on_train_batch_start(self, *_args: Any) -> None:
        self._in_schedule = self._in_passes = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, *_args: Any) -> None:
        if getattr(trainer.strategy, "pipeline", None) is not None:
            self.schedule_s.append(self._in_schedule)
            self.passes_s.append(self._in_passes)


QUIET_TRAINER = {  # a timed run: no validation, logging, checkpoints or console output
    "limit_val_batches": 0,
    "num_sanity_val_steps": 0,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def make_strategy(run: dict, topology: Topology, timeout_s: float) -> Strategy:
    timeout = timedelta(seconds=timeout_s)
    if run["strategy"] == "fsdp":
        return ModelParallelStrategy(
            data_parallel_size=topology.world_size,
            tensor_parallel_size=1,
            process_group_backend="gloo",
            timeout=timeout,
        )
    if run["strategy"] == "ddp":
        return DDPStrategy(process_group_backend="gloo", timeout=timeout)
    return HolmesStrategy(cluster=topology, plan=Plan.from_json(run["plan"]), timeout=timeout)


def train(spec: dict, run: dict, topology: Topology, rank: int) -> dict:
    """Train one run (a fresh Trainer, strategy and model, the same data) and return this rank's step times, losses and
    the seconds from the start of the run to its first step (`setup_s`: Trainer, process groups, model, data)."""
    started = time.perf_counter()
    out = Path(spec["out_dir"])
    L.seed_everything(spec["seed"], workers=True)
    trained = BenchModel.from_spec(spec)
    data = ByteCorpusDataModule(
        seq_len=trained.seq_len,
        global_batch=spec["global_batch"],
        corpus_bytes=spec["corpus_bytes"],
        seed=spec["seed"],
        dict_batches=trained.dict_batches,
    )
    trace_step = spec["warmup_steps"] if spec["trace"] else None
    timer = StepTimer(run["name"], spec["steps"], trace_step, out / f"trace_{run['name']}_rank{rank}.json")
    passes = PassTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=len(topology.node_of(rank).ranks),
        num_nodes=len(topology.nodes),
        strategy=make_strategy(run, topology, spec["timeout_s"]),
        max_steps=spec["steps"],
        **QUIET_TRAINER,
        callbacks=[timer, passes],
        default_root_dir=str(out),
    )
    before_model, files_before_model = resident_bytes(), file_resident_bytes()
    restart_peak_resident()  # the peak from here: start-up's own (imports, the Trainer) may be higher than training's
    with trainer.init_module(empty_init=True) if spec.get("meta") else nullcontext():
        model = trained.build(flat_fsdp=run["strategy"] == "fsdp")
    trainer.fit(model, datamodule=data)
    plan_mesh = getattr(trainer.strategy, "plan_mesh", None)
    stage = None if plan_mesh is None else plan_mesh.stage
    setup_s = timer.first_step_at - started
    if trainer.is_global_zero:
        print(f"  {run['name']}: {setup_s:.1f} s from the run's start to its first step", flush=True)
    return {
        "name": run["name"],
        "step_s": timer.seconds,
        "loss": timer.losses,
        "schedule_s": passes.schedule_s,
        "passes_s": passes.passes_s,
        "setup_s": setup_s,
        "stage": stage,
        "rss_before_model_bytes": before_model,
        "file_rss_before_model_bytes": files_before_model,
    }


def main(spec: dict) -> None:
    """Every run of the spec in order, in this one process (later runs reuse the default process group)."""
    skip_exit_collections()
    rank = default_environment().global_rank()
    topology = Topology.from_dict(spec["topology"])
    runs = [train(spec, run, topology, rank) for run in spec["runs"]]
    result = {
        "rank": rank,
        "runs": runs,
        "baseline_rss_bytes": runs[0]["rss_before_model_bytes"],
        "peak_rss_bytes": peak_resident_bytes(),
        "baseline_file_rss_bytes": runs[0]["file_rss_before_model_bytes"],
        "end_file_rss_bytes": file_resident_bytes(),
    }
    (Path(spec["out_dir"]) / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
