"""Before a job trains, its ranks agree on one Plan (HolmesStrategy's `setup` calls `agree_on_plan`).

Rank 0 reads one sample of the model's inputs, profiles `pipeline_layers()` on it, calibrates this machine on them
(`measure.calibration`; what needs every rank, a message between two and a step's closing collectives, is timed by
all of them first) and plans for the job's Topology; every rank gets the plan and the calibration, or rank 0's error.
A resume first asks whether its checkpoint's plan fits this job unchanged (`plan_reuse`): then rank 0 sends every rank
that plan, and nothing is read, profiled or calibrated.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import Any, TypeVar, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import holmes_lightning.runtime.checkpoint as checkpoint
from holmes_lightning.measure import calibration
from holmes_lightning.measure.calibration import Calibration
from holmes_lightning.measure.host import available_cores, rank_share, training_memory_gb
from holmes_lightning.measure.layer_io import as_tuple
from holmes_lightning.measure.profile import first_sample, profile_modules
from holmes_lightning.measure.together import cross_node_partners, handoff, step_collectives_s
from holmes_lightning.planner import (
    Backend,
    BatchSettings,
    LayerProfile,
    LayoutKind,
    MachineCosts,
    ModelProfile,
    PartitionRule,
    Plan,
    PlanOptions,
    best_plan,
    best_plan_per_replica,
)
from holmes_lightning.planner.report import format_plan
from holmes_lightning.planner.search import SearchStats
from holmes_lightning.runtime.contract import Inputs, dict_inputs, missing_contract, prediction_inputs, split_batch
from holmes_lightning.runtime.placement import host_position
from holmes_lightning.runtime.plan_reuse import PlanBasis, digest, replan_reasons
from holmes_lightning.runtime.preemption import HolmesCheckpoint
from holmes_lightning.topology import Topology

LOOPS = {
    TrainerFn.FITTING: ("fit_loop", "train_dataloader"),
    TrainerFn.VALIDATING: ("validate_loop", "val_dataloader"),
    TrainerFn.TESTING: ("test_loop", "test_dataloader"),
    TrainerFn.PREDICTING: ("predict_loop", "predict_dataloader"),
}
T = TypeVar("T")
RANK_ZERO_WAIT = timedelta(days=1)  # the ranks wait for rank 0's plan (`from_rank_zero`) as long as planning takes
_MADE = itertools.count()  # `from_rank_zero` calls so far in this process


@dataclass(frozen=True)
class PlanRequest:
    """What HolmesStrategy was asked for: plan settings, the batch, the machine's costs where it does not calibrate
    them, whether to calibrate (in the Trainer's `precision`), a plan or profile given instead of made, and whether a
    resume plans afresh (`replan`) rather than run its checkpoint's plan again."""

    options: PlanOptions
    batch: BatchSettings | None
    costs: MachineCosts
    calibrate: bool
    plan: Plan | None = None
    profile: ModelProfile | None = None
    precision: str = "32-true"
    replan: bool = False

    def fixed_settings(self, backend: Backend) -> dict[str, Any]:
        """Everything asked for that fixes a plan whatever the machine measures: the plan settings (with the job's
        collective library), the batch, the precision, whether to calibrate, the given costs, the given profile (a
        digest) and whether the plan itself was given. Not `replan`: it says only whether to reuse a stored plan."""
        batch = self.batch
        return {
            **asdict(replace(self.options.settings(), backend=backend)),
            "global_batch": None if batch is None else batch.global_batch,
            "microbatches": None if batch is None else batch.microbatches,
            "precision": self.precision,
            "calibrate": self.calibrate,
            "costs": asdict(self.costs),
            "profile": None if self.profile is None else digest(asdict(self.profile)),
            "given_plan": self.plan is not None,
        }


@dataclass
class SampleReading:
    """What the DataLoader asked of the strategy while rank 0 read it before there was a plan, its data split given
    `replicas` provisional DP replicas."""

    replicas: int = 1
    asked_batch_size: bool = False
    asked_split: bool = False


ReadingData = Callable[[int], AbstractContextManager[SampleReading]]  # entered while rank 0 reads a DataLoader


@dataclass(frozen=True)
class LoaderBatch:
    """The batch size a DataLoader chose itself rather than asking for `replica_batch_size`: what each DP replica
    reads per step, as under DDP; or, `divided`, the global batch, which it divides among the replicas that
    `distributed_sampler_kwargs` gives it (its batch size fell from one replica to two)."""

    size: int
    divided: bool = False


@dataclass(frozen=True)
class DataSample:
    """One sample's inputs to the first layer (None: not needed), and the DataLoader's own batch (None: it has none,
    or it asks for `replica_batch_size`)."""

    inputs: Inputs | None
    batch: LoaderBatch | None = None


@dataclass(frozen=True)
class AgreedPlan:
    """The job's plan, what calibration measured for it (None: not calibrated), both in words for the log, and what
    the plan was made for (the checkpoints' record of it)."""

    plan: Plan
    calibration: Calibration | None
    description: str
    made_for: PlanBasis


@dataclass(frozen=True)
class StoredPlanVerdict:
    """Whether a resume runs its checkpoint's `plan` again (None: it plans afresh), and the log line that says why."""

    plan: Plan | None
    line: str


@dataclass(frozen=True)
class JobPlace:
    """Where this job runs: its Topology, this rank's device and collective library, and how to reach every rank."""

    topology: Topology
    device: torch.device
    backend: Backend
    local_rank: int
    local_processes: int
    broadcast: Callable[[Any], Any]  # rank 0's object on every rank


def agree_on_plan(
    request: PlanRequest,
    *,
    trainer: pl.Trainer,
    place: JobPlace,
    reading_data: ReadingData,
    resuming: str | None = None,
) -> AgreedPlan:
    """Every rank calls it; all return rank 0's plan and calibration, or raise rank 0's error.

    `reading_data(replicas)`: entered while rank 0 reads the user's DataLoader (the strategy's data split must
    answer then, before there is a plan, for that many provisional replicas). `resuming`: the checkpoint the run
    restores after setup (rank 0's counts): its plan runs again, uncalibrated, where nothing that fixes a plan changed
    (`plan_reuse`).
    """
    made_for = PlanBasis.of(place.topology, request.fixed_settings(place.backend))
    verdict = from_rank_zero(
        lambda: _judge_stored_plan(
            request, trainer=trainer, place=place, reading_data=reading_data, made_for=made_for, resuming=resuming
        ),
        place.broadcast,
    )
    if verdict is not None and verdict.plan is not None:
        return AgreedPlan(verdict.plan, None, f"{verdict.line}\n{format_plan(verdict.plan)}", made_for)
    agreed = _agree_on_a_new_plan(request, trainer=trainer, place=place, reading_data=reading_data, made_for=made_for)
    return agreed if verdict is None else replace(agreed, description=f"{verdict.line}\n{agreed.description}")


def _agree_on_a_new_plan(
    request: PlanRequest,
    *,
    trainer: pl.Trainer,
    place: JobPlace,
    reading_data: ReadingData,
    made_for: PlanBasis,
) -> AgreedPlan:
    """Calibrate (every rank the collective part, rank 0 the rest) and plan on rank 0; every rank gets the result."""
    module = trainer.lightning_module
    calibrating = request.calibrate and request.plan is None and not missing_contract(module)
    together = _measured_together(trainer, place) if calibrating else {}
    alone = dist.new_group([0]) if calibrating else None  # FSDP2 is timed on a group of rank 0 alone
    try:
        return from_rank_zero(
            lambda: _plan_on_rank_zero(
                request,
                trainer=trainer,
                place=place,
                reading_data=reading_data,
                together=together,
                group=alone,
                made_for=made_for,
            ),
            place.broadcast,
        )
    finally:
        if alone is not None and dist.get_rank() == 0:
            dist.destroy_process_group(alone)


def from_rank_zero(make: Callable[[], T], broadcast: Callable[[Any], Any]) -> T:
    """`make()` run on rank 0, its result on every rank (`broadcast`: rank 0's object on every rank); its error raised
    on every rank.

    The other ranks first wait in the job's store until rank 0 is done, for up to `RANK_ZERO_WAIT` rather than the
    collective timeout: planning may take minutes, reporting progress as it goes, and a short collective timeout is
    there to catch hangs. A rank 0 that dies ends the wait (its store goes with it, or its launcher stops the job).
    """
    outcome: T | Exception | None = None
    done = f"holmes/rank-zero-done/{next(_MADE)}"  # every rank calls this in the same order: the same key
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        try:
            outcome = make()
        except Exception as error:  # any failure must reach the other ranks, or they wait for rank 0 forever
            outcome = error
        store.set(done, "")
    else:
        store.wait([done], RANK_ZERO_WAIT)
    outcome = broadcast(outcome)
    if isinstance(outcome, Exception):
        raise outcome
    return cast(T, outcome)


def _judge_stored_plan(
    request: PlanRequest,
    *,
    trainer: pl.Trainer,
    place: JobPlace,
    reading_data: ReadingData,
    made_for: PlanBasis,
    resuming: str | None,
) -> StoredPlanVerdict | None:
    """On rank 0: may the resume from `resuming` run its checkpoint's plan again (None: no resume, or a given plan)?

    An unreadable plan.json means a new plan here; the checkpoint's load then says what is wrong with it.
    """
    if resuming is None or request.plan is not None:
        return None
    stored = f"the plan stored with checkpoint {resuming}"
    if request.replan:
        return StoredPlanVerdict(None, f"holmes: a new plan, not {stored}: replan=True")
    try:
        saved, saved_for = checkpoint.stored_plan(resuming)
    except Exception as error:  # missing, truncated or foreign: not a plan to run
        return StoredPlanVerdict(None, f"holmes: a new plan: no readable plan in {resuming} ({error})")
    module = trainer.lightning_module
    replica_batch = None
    if request.batch is None and not missing_contract(module):  # the DataLoader's batch size fixed the plan's batch
        replica_batch = _replica_batch(trainer, reading_data, saved.dp)
    reasons = replan_reasons(
        saved,
        saved_for,
        current=made_for,
        world_size=place.topology.world_size,
        num_layers=_layer_count(module, request),
        replica_batch=replica_batch,
    )
    if reasons:
        return StoredPlanVerdict(None, f"holmes: a new plan, not {stored}: {'; '.join(reasons)}")
    return StoredPlanVerdict(
        saved,
        f"holmes: running {stored} again (same cluster, model and plan settings; nothing calibrated): "
        f"replan=True (train.py: strategy.replan=true) makes a new one",
    )


def _layer_count(module: pl.LightningModule, request: PlanRequest) -> int:
    """The pipeline layers a plan for this model splits: the given profile's, else `pipeline_layers()` (or one)."""
    if request.profile is not None:
        return request.profile.num_layers
    return 1 if missing_contract(module) else len(module.pipeline_layers())


@contextmanager
def _provisional_loader(
    trainer: pl.Trainer, reading_data: ReadingData, replicas: int
) -> Iterator[tuple[Any, SampleReading]]:
    """The running entry point's DataLoader as built for `replicas` provisional DP replicas, and what it asked of the
    strategy; the random state is left as it was, so rank 0 draws the same numbers afterwards as the other ranks."""
    states = _collect_rng_states()
    try:
        with reading_data(replicas) as reading:
            yield _data_loader(trainer, type(trainer.lightning_module).__name__), reading
    finally:
        _set_rng_states(states)


def _replica_batch(trainer: pl.Trainer, reading_data: ReadingData, dp: int) -> int | None:
    """The samples per step the DataLoader chose itself for each of `dp` DP replicas (None: it asks for one)."""
    with _provisional_loader(trainer, reading_data, dp) as (loader, reading):
        return None if reading.asked_batch_size else _batch_size(loader)


def _loader_batch(
    trainer: pl.Trainer, reading_data: ReadingData, loader: Any, reading: SampleReading
) -> LoaderBatch | None:
    """The batch `loader`, built for one replica, chose itself; one that asked for the data split is built again for
    two, to tell a batch per replica from a global batch it divides among them."""
    size = None if reading.asked_batch_size else _batch_size(loader)
    if size is None:
        return None
    return LoaderBatch(size, divided=reading.asked_split and _replica_batch(trainer, reading_data, 2) != size)


def _measured_together(trainer: pl.Trainer, place: JobPlace) -> dict[str, float]:
    """The `MachineCosts` every rank measures at once: a message's latency and CPU while all compute (between nodes,
    as stages' messages cross them), and what a pipelined step's closing collectives take."""
    message = handoff(place.device, partners=cross_node_partners(place.topology))
    closing = step_collectives_s(place.device, step_collectives(trainer))
    return {"latency_s": message.latency_s, "message_cpu_s": message.cpu_s, "closing_s": closing}


def _plan_on_rank_zero(
    request: PlanRequest,
    *,
    trainer: pl.Trainer,
    place: JobPlace,
    reading_data: ReadingData,
    together: dict[str, float],
    group: dist.ProcessGroup | None,
    made_for: PlanBasis,
) -> AgreedPlan:
    module = trainer.lightning_module
    data = _model_sample(trainer, request, reading_data)
    sample = data.inputs
    profile = request.profile or _profile(module, sample)
    measured = None
    if request.plan is not None:
        chosen = _checked(request.plan, place.topology)
    else:
        if together and sample is not None:
            measured = _calibrate(module, sample, profile, place=place, together=together, group=group, request=request)
        costs = measured.costs if measured else None
        chosen = _make_plan(module, request, profile=profile, place=place, costs=costs, loader=data.batch)
    _check_stages_hold_parameters(chosen, profile)
    description = format_plan(chosen, profile)
    if measured is not None:
        description += f"\n  calibrated: {measured.describe()}"
        if measured.costs.efficiency > 1:
            configured = place.topology.node_of(0).device_tflops
            description += (
                f"\n  note: a rank here computes {measured.device_tflops:.3g} TFLOPS on this model, above the "
                f"{configured:g} the cluster config gives its device: planned with the measurement; set device_tflops"
            )
    return AgreedPlan(chosen, measured, description, made_for)


def _check_stages_hold_parameters(plan: Plan, profile: ModelProfile) -> None:
    """Every stage's ranks build the module's optimizers over the parameters they hold, and torch's optimizers refuse
    an empty list: a stage of parameterless layers only (activations, reshapes) is refused here, on rank 0."""
    for stage in plan.stages:
        if not any(profile.layers[layer].param_bytes for layer in stage.layers):
            names = ", ".join(profile.layers[layer].name for layer in stage.layers)
            raise ValueError(
                f"the plan's stage {stage.index} (ranks {list(stage.ranks)}) holds only pipeline layers without "
                f"parameters ({names}): its ranks would build an optimizer over nothing, which torch refuses; give "
                f"those layers to a neighbouring stage (HolmesStrategy(partition=[...]), strategy.partition in "
                f"configs) or plan fewer stages (pp)"
            )


def _model_sample(trainer: pl.Trainer, request: PlanRequest, reading_data: ReadingData) -> DataSample:
    """One sample's inputs to the first layer (samples first) to profile and time `pipeline_layers()` on:
    `example_input_array` (a tensor, a tuple of them, or a dict batch), else one sample of the running entry point's
    DataLoader; None without pipeline layers or with a given profile. Without a global batch, the DataLoader is read
    for its batch size too (`_loader_batch`).
    """
    module = trainer.lightning_module
    if missing_contract(module):
        return DataSample(None)
    example = module.example_input_array
    given = request.profile is not None and not request.calibrate  # nothing to profile or time
    inputs = None
    if example is not None and not given:
        inputs = dict_inputs(example) if isinstance(example, Mapping) else as_tuple(example)
    reads_inputs = example is None and not given
    if request.batch is not None and not reads_inputs:
        return DataSample(inputs)
    with _provisional_loader(trainer, reading_data, 1) as (loader, reading):
        if reads_inputs:  # else only the loader's batch size is wanted: no sample read
            batch = first_sample(loader)
            inputs = prediction_inputs(batch) if trainer.state.fn == TrainerFn.PREDICTING else split_batch(batch)[0]
    if request.batch is not None:
        return DataSample(inputs)
    return DataSample(inputs, _loader_batch(trainer, reading_data, loader, reading))


def _batch_size(loader: Any) -> int | None:
    """The samples a DataLoader yields per batch, where it says (its `batch_size`, or its batch sampler's)."""
    size = getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _data_loader(trainer: pl.Trainer, model_name: str) -> Any:
    """The DataLoader the running entry point (fit, validate, test, predict) reads; the first of several."""
    loop, hook = LOOPS[trainer.state.fn]
    source = getattr(trainer, loop)._data_source
    fix = (
        f"set `self.example_input_array = <inputs of one batch, samples first>` in {model_name}.__init__, or pass "
        f"HolmesStrategy(profile=...)"
    )
    if not source.is_defined():
        raise ValueError(f"HolmesStrategy profiles pipeline_layers() on one sample, but there is no {hook}(); {fix}")
    try:
        loaders = source.dataloader()
    except RuntimeError as error:
        raise RuntimeError(
            f"HolmesStrategy reads one sample of {hook}() to profile the model before it plans, and that failed: "
            f"{error}; {fix}"
        ) from error
    while isinstance(loaders, list | tuple | dict):  # several loaders: the first one's
        loaders = next(iter(loaders.values())) if isinstance(loaders, dict) else loaders[0]
    return loaders


def _profile(module: pl.LightningModule, sample: Inputs | None) -> ModelProfile:
    """`pipeline_layers()` measured on `sample`; one layer of the whole model's bytes without them."""
    if sample is None:
        param_bytes = float(sum(p.numel() * p.element_size() for p in module.parameters()))
        return ModelProfile(type(module).__name__, (LayerProfile("model", 0.0, 0.0, param_bytes, 0.0, 0.0),), 1)
    states = _collect_rng_states()
    try:
        return profile_modules(module.pipeline_layers(), sample, name=type(module).__name__)
    finally:
        _set_rng_states(states)


def _calibrate(
    module: pl.LightningModule,
    sample: Inputs,
    profile: ModelProfile,
    *,
    place: JobPlace,
    together: dict[str, float],
    group: dist.ProcessGroup | None,
    request: PlanRequest,
) -> Calibration:
    """This rank's costs on the model in the request's precision (`calibration.measure`, cached per machine, model
    shape and precision), compute as a fraction of the configured speed of rank 0's device; what is not measured
    stays as the request's costs. CPU ranks that all run on this host share its cores (the planner times that);
    spread over hosts, each is credited its share of its host's cores."""
    layers = module.pipeline_layers()
    measured = calibration.measure(layers, sample, device=place.device, group=group, precision=request.precision)
    assumed = request.costs
    topology = place.topology
    share = 1.0
    if place.device.type == "cpu":
        host_ranks = host_position(os.environ, place.local_rank, place.local_processes)[1]
        if host_ranks == topology.world_size:
            assumed = replace(assumed, shared_cores=available_cores())
        else:
            share = rank_share(host_ranks)
    peak = topology.node_of(0).device_tflops
    return Calibration.of(measured, profile, share=share, peak_tflops=peak, assumed=assumed, **together)


def _checked(given: Plan, topology: Topology) -> Plan:
    if len(given.pp_links) != given.dp:
        raise ValueError(
            f"plan= (version {given.version}) does not say which link each pipeline group uses (pp_links); plan "
            f"again with this version (holmes-plan ... plan.json=FILE, or HolmesStrategy without plan=)"
        )
    if given.world_size != topology.world_size:
        raise ValueError(
            f"plan= has {given.pp} stages x {given.dp} ranks = {given.world_size} ranks, but cluster "
            f"{topology.name!r} has {topology.world_size}; plan for this cluster"
        )
    return given


def _make_plan(
    module: pl.LightningModule,
    request: PlanRequest,
    *,
    profile: ModelProfile,
    place: JobPlace,
    costs: MachineCosts | None,
    loader: LoaderBatch | None,
) -> Plan:
    """The best plan for the request on this job's hardware, at the calibrated `costs` (None: the request's);
    without the request's global batch, for the DataLoader's own batch (`loader`)."""
    topology = place.topology
    options = replace(request.options, backend=place.backend)
    costs = costs or request.costs
    if costs.device_memory_gb is None:  # a bound by default: what this rank's device (or share of the host) holds
        host_ranks = host_position(os.environ, place.local_rank, place.local_processes)[1]
        costs = replace(costs, device_memory_gb=training_memory_gb(place.device, host_ranks))
    if missing_contract(module):  # pp=1: one FSDP group over every rank
        batch = BatchSettings((request.batch or BatchSettings(topology.world_size)).global_batch)
        whole = replace(options, layout=LayoutKind.flat_fsdp, pp=None, dp=None, partition=PartitionRule.auto)
        found = best_plan(topology, profile, batch, options=whole, costs=costs, stats=_reporting())
        return replace(found, notes=(*found.notes, "no pipeline contract (pipeline_layers): FSDP over all ranks"))
    if request.batch is not None:
        return best_plan(topology, profile, request.batch, options=options, costs=costs, stats=_reporting())
    if loader is None:
        raise ValueError(
            "HolmesStrategy(global_batch=None): the planner needs the samples per optimizer step, and the DataLoader "
            "does not fix them (it asks for strategy.replica_batch_size, or has no batch_size); pass "
            "global_batch=<sequences per step over all DP replicas>, or give the DataLoader a batch_size: each DP "
            "replica then reads one such batch per step"
        )
    if loader.divided:
        batch = BatchSettings(loader.size)
        found = best_plan(topology, profile, batch, options=options, costs=costs, stats=_reporting())
        note = (
            f"global batch {loader.size}: the DataLoader's batch_size with one replica, which it divides among the "
            f"replicas of distributed_sampler_kwargs ({found.replica_batch} each at dp={found.dp})"
        )
    else:
        found = best_plan_per_replica(topology, profile, loader.size, options=options, costs=costs, stats=_reporting())
        note = f"global batch {found.global_batch}: the DataLoader's batch_size={loader.size} x dp={found.dp}"
    return replace(found, notes=(*found.notes, note))


def _reporting() -> SearchStats:
    """Search stats that log how a long search goes (this runs on rank 0 while the other ranks wait)."""
    return SearchStats.reporting(rank_zero_info)


def step_collectives(trainer: pl.Trainer) -> int:
    """The small collectives over every rank a pipelined training step runs after its schedule: the loss's
    all-reduce, the training loop's broadcast of rank 0's stop signal (Lightning 2.5+), the clipping norm's
    all-reduce, each HolmesCheckpoint's stop vote."""
    count = 1 + hasattr(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor")
    count += bool(trainer.gradient_clip_val) and trainer.gradient_clip_algorithm in (None, "norm")
    return count + sum(isinstance(callback, HolmesCheckpoint) for callback in trainer.callbacks)
