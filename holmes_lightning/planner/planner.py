"""`plan()`: the Holmes scheduler. Picks degrees, a NIC-aware rank layout, a partition and micro-batches."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from holmes_lightning.planner.candidate import GB, Candidate, RangeCosts, predict_step
from holmes_lightning.planner.cost import CostModel, sync_bytes
from holmes_lightning.planner.layout import (
    Layout,
    StageHardware,
    dp_degrees,
    flat_layout,
    group_orders,
    holmes_layout,
    megatron_layout,
    pipeline_links,
)
from holmes_lightning.planner.partition import split_chunks, uniform_partition
from holmes_lightning.planner.plan_types import Plan, Sharding, StagePlan
from holmes_lightning.planner.profile import ModelProfile
from holmes_lightning.planner.schedules import SCHEDULES, microbatch_problem
from holmes_lightning.planner.search import SearchStats, search
from holmes_lightning.topology import Topology

LAYOUTS = ("holmes", "nic_unaware", "flat_fsdp")
SHARDINGS = tuple(Sharding)
BACKENDS = ("nccl", "gloo")


class PlanError(ValueError):
    """No plan satisfies the request; the message names the setting, its value and a fix."""


@dataclass(frozen=True)
class BatchSettings:
    """Samples (sequences) per optimizer step over all DP ranks; `microbatches=None` lets the planner choose."""

    global_batch: int
    microbatches: int | None = None


@dataclass
class PlanOptions:
    """What to plan: the one set of plan settings HolmesStrategy (`options=`), train.py, the plan CLI and the bench
    take (in configs, the `strategy` node: `strategy.pp=2`, `strategy.memory_limit_gb=80`).

    partition: "auto" (minimise the predicted step), "uniform", or layers per stage (per virtual stage also
    accepted for Interleaved1F1B). pp / dp: None = choose. layout: "holmes", "nic_unaware" (Megatron-LM rank order)
    or "flat_fsdp". sharding inside each stage: "fsdp", "none" (full replicas, gradients all-reduced) or "auto"
    (the faster of the two, FSDP on a tie since it needs less memory). backend: the collective library ("nccl" or
    "gloo"; gloo's reduce-scatter costs a whole all-reduce). chunks_per_stage: model chunks per stage for
    Interleaved1F1B. efficiency: fraction of peak
    TFLOPS layers reach. layer_overhead_s: seconds each layer adds to every micro-batch whatever its size (kernel
    launches, framework hooks), so more micro-batches are not free. optimizer_s_per_gb: optimizer step seconds per
    GB of parameters a rank holds. latency_s: seconds every message adds whatever its size (a pipeline transfer, each
    step of a ring collective). fsdp_layer_s / fsdp_reshard_layer_s: FSDP2's hooks per layer and micro-batch with
    the weights kept gathered (a pipeline) / freed after forward (pp=1); fsdp_optimizer_layer_s: what DTensor
    parameters add to the optimizer step per layer (see `CostModel`; HolmesStrategy measures all of these, and
    efficiency, at job start). dp_overlap: fraction of DP sync hidden under the computation without a pipeline.
    state_multiplier: bytes of weights, grads and optimizer state per parameter byte. memory_limit_gb: per device,
    None = unchecked. shared_cores: every rank computes on this many CPU cores of one machine (HolmesStrategy sets it
    for CPU ranks on one host, the bench for the lab); None: each rank on its own device. closing_s: seconds a
    pipelined step spends after its schedule in small collectives over every rank (HolmesStrategy measures them);
    None: the loss's all-reduce at latency_s. message_cpu_s: CPU seconds both ends of a pipeline message spend on it,
    which ranks sharing cores lose for computing (HolmesStrategy measures it for CPU ranks on one host).
    """

    schedule: str = "1F1B"
    partition: Any = "auto"  # "auto", "uniform" or a list of layer counts (Hydra takes no union of str and list)
    pp: int | None = None
    dp: int | None = None
    layout: str = "holmes"
    sharding: Sharding = Sharding.auto
    backend: str = "nccl"
    chunks_per_stage: int = 2
    efficiency: float = 0.5
    layer_overhead_s: float = 0.0
    optimizer_s_per_gb: float = 0.0
    latency_s: float = 0.0
    fsdp_layer_s: float = 0.0
    fsdp_reshard_layer_s: float = 0.0
    fsdp_optimizer_layer_s: float = 0.0
    dp_overlap: float = 0.5
    state_multiplier: float = 4.0
    memory_limit_gb: float | None = None
    shared_cores: float | None = None
    closing_s: float | None = None
    message_cpu_s: float = 0.0

    @property
    def chunks(self) -> int:
        return self.chunks_per_stage if self.schedule == "Interleaved1F1B" else 1


def cost_model(topology: Topology, profile: ModelProfile, options: PlanOptions, sharding: Sharding) -> CostModel:
    """The cost model `options` describe, for plans of this `sharding`."""
    return CostModel(
        topology,
        profile,
        options.efficiency,
        options.dp_overlap,
        sharding,
        options.state_multiplier,
        backend=options.backend,
        layer_overhead_s=options.layer_overhead_s,
        optimizer_s_per_gb=options.optimizer_s_per_gb,
        latency_s=options.latency_s,
        fsdp_layer_s=options.fsdp_layer_s,
        fsdp_reshard_layer_s=options.fsdp_reshard_layer_s,
        fsdp_optimizer_layer_s=options.fsdp_optimizer_layer_s,
        shared_cores=options.shared_cores,
        closing_s=options.closing_s,
        message_cpu_s=options.message_cpu_s,
    )


def plan(
    topology: Topology,
    profile: ModelProfile,
    batch: BatchSettings,
    options: PlanOptions | None = None,
    stats: SearchStats | None = None,
) -> Plan:
    """The plan with the lowest simulated step among every one the options allow (`stats`: filled with the search).

    Candidates are every layout (NIC group order and DP size), micro-batch count and sharding the options allow;
    `search.search` finds the best split of each that could beat the best so far. Ties go to FSDP, then fewer DP
    ranks, config order, fewer micro-batches.
    """
    options = options or PlanOptions()
    _check_request(profile, batch, options)
    stats = stats if stats is not None else SearchStats()
    problems: list[str] = []
    options = replace(options, sharding=Sharding(options.sharding))
    limit = options.memory_limit_gb * GB if options.memory_limit_gb else None
    layouts = _layouts(topology, options, profile, problems)
    hardware = [StageHardware.of(topology, layout) for layout in layouts]
    stats.layouts += len(layouts)
    shardings = (Sharding.fsdp, Sharding.none) if options.sharding is Sharding.auto else (options.sharding,)
    candidates = []
    shared: dict[tuple, RangeCosts] = {}
    for i, sharding in enumerate(shardings):  # FSDP first: replicas win only when strictly faster
        cost = cost_model(topology, profile, options, sharding)
        for j, (layout, stage_hardware) in enumerate(zip(layouts, hardware, strict=True)):
            if options.sharding is Sharding.auto and _dominated(sharding, layout, options):
                continue
            for k, microbatches in enumerate(_microbatch_counts(layout, profile, batch, options, problems)):
                microbatch_size = batch.global_batch // layout.dp // microbatches
                candidate = Candidate(
                    layout=layout,
                    hardware=stage_hardware,
                    cost=replace(cost, rdma=layout.rdma),
                    schedule=options.schedule,
                    chunks=options.chunks,
                    microbatches=microbatches,
                    microbatch_size=microbatch_size,
                    memory_limit=limit,
                    range_costs=shared.setdefault((sharding, microbatch_size), RangeCosts()),
                )
                candidates.append(((i, j, k), candidate))

    def infeasible(candidate: Candidate, counts: tuple[int, ...] | None) -> None:
        problems.append(_memory_problem(candidate, counts, options))

    best = search(candidates, lambda candidate: _fixed_counts(options, candidate), stats, infeasible)
    if best is None:
        reasons = "\n  ".join(dict.fromkeys(problems)) or "no layout fits"
        raise PlanError(f"no feasible plan for {topology.name!r} and {profile.name!r}:\n  {reasons}")
    return _as_plan(best.candidate, best.counts, options)


def _dominated(sharding: Sharding, layout: Layout, options: PlanOptions) -> bool:
    """A sharding the other one is never slower than on this layout, so `auto` need not try it.

    One rank per stage: nothing to shard (the runtime leaves such groups plain), equal costs: replicas. In a pipeline
    on NCCL whose hooks and messages cost nothing extra, FSDP's all-gather + reduce-scatter move what an all-reduce
    moves, and its optimizer step and memory are smaller: FSDP. (Without a pipeline FSDP gathers twice.)
    """
    if layout.dp == 1:
        return sharding is Sharding.fsdp
    free = options.latency_s == options.fsdp_layer_s == options.fsdp_optimizer_layer_s == 0
    pipelined = layout.pp * options.chunks > 1
    return options.backend == "nccl" and pipelined and free and sharding is Sharding.none


def _memory_problem(candidate: Candidate, counts: tuple[int, ...] | None, options: PlanOptions) -> str:
    """Why a candidate's split (None: every split) does not fit `strategy.memory_limit_gb`, and what to change."""
    fix = "use more stages (strategy.pp) or micro-batches (strategy.microbatches), or a larger limit"
    fix += ", or strategy.sharding=fsdp" if candidate.cost.sharding is not Sharding.fsdp else ""
    if counts is None:
        return (
            f"no partition of {candidate.cost.profile.name!r} over pp={candidate.layout.pp} with "
            f"{candidate.microbatches} micro-batches fits strategy.memory_limit_gb={options.memory_limit_gb} per "
            f"device; {fix}"
        )
    worst = max(candidate.stage_plans(counts), key=lambda stage: stage.memory_gb)
    return (
        f"stage {worst.index} (ranks {list(worst.ranks)}) needs about {worst.memory_gb:.1f} GB per device, above "
        f"strategy.memory_limit_gb={options.memory_limit_gb}; {fix}"
    )


def _fixed_counts(options: PlanOptions, candidate: Candidate) -> tuple[int, ...] | None:
    """Layers per virtual stage of a uniform or explicit partition (None: `auto`, searched)."""
    num_layers, pp, chunks = candidate.num_layers, candidate.layout.pp, candidate.chunks
    if options.partition == "auto":
        return None
    if options.partition == "uniform":
        return uniform_partition(num_layers, pp * chunks)
    counts = tuple(options.partition)
    return counts if len(counts) == pp * chunks else split_chunks(counts, chunks)


def _as_plan(candidate: Candidate, counts: tuple[int, ...], options: PlanOptions) -> Plan:
    stages = candidate.stage_plans(counts)
    layout = candidate.layout
    return Plan(
        layout=layout.name,
        schedule=options.schedule,
        stages=tuple(stages),
        microbatches=candidate.microbatches,
        microbatch_size=candidate.microbatch_size,
        prediction=candidate.predict(stages),
        num_layers=candidate.num_layers,
        notes=_notes(layout, stages),
        partition=options.partition if isinstance(options.partition, str) else "explicit",
        sharding=candidate.cost.sharding,
        tokens_per_sample=candidate.cost.profile.tokens_per_sample,
        rdma=layout.rdma,
        pp_links=pipeline_links(candidate.cost.topology, layout),
        shared_cores=candidate.cost.shared_cores,
        backend=candidate.cost.backend,
    )


def on_shared_cores(
    plan_: Plan, profile: ModelProfile, *, cores: float, share: float, transfer_cpu_s_per_byte: float = 0.0
) -> Plan:
    """`plan_` (planned for a device per rank, each computing at `share` of one of these cores) as it runs with every
    rank on `cores` CPU cores of one machine: the same layout, its passes at their speed alone while no more ranks than
    cores compute (`planner.sharing`), predicted again.

    `transfer_cpu_s_per_byte`: what moving a byte between two ranks costs the cores (sender, receiver and the kernel
    between them). A pipeline message's cost joins the pass that sends it, so it slows the ranks computing beside it;
    the DP sync's, every rank's at once, lengthens each stage's exposed sync by all of it spread over the cores.
    """
    cpu = transfer_cpu_s_per_byte
    out_bytes = [layer.activation_bytes * plan_.microbatch_size for layer in profile.layers]
    last = profile.num_layers
    moved = sum(  # every rank of every group syncs at once
        len(stage.ranks)
        * sync_bytes(
            plan_.sharding,
            plan_.backend,
            len(stage.ranks),
            sum(profile.layers[i].param_bytes for i in stage.layers),
            pipelined=plan_.is_pipelined,
        )
        for stage in plan_.stages
    )
    sync_cpu_s = cpu * moved / cores
    stages = tuple(
        replace(
            stage,
            forward_s=tuple(
                seconds * share + (cpu * out_bytes[stop - 1] if stop < last else 0.0)
                for seconds, (_, stop) in zip(stage.forward_s, stage.chunks, strict=True)
            ),
            backward_s=tuple(
                seconds * share + (cpu * out_bytes[start - 1] if start > 0 else 0.0)
                for seconds, (start, _) in zip(stage.backward_s, stage.chunks, strict=True)
            ),
            exposed_sync_s=stage.exposed_sync_s + (sync_cpu_s if len(stage.ranks) > 1 else 0.0),
        )
        for stage in plan_.stages
    )
    prediction = predict_step(
        stages, plan_.schedule, plan_.microbatches, plan_.microbatch_size, profile, cores, plan_.backend
    )
    return replace(plan_, stages=stages, prediction=prediction, shared_cores=cores)


def compare(
    topology: Topology,
    profile: ModelProfile,
    batch: BatchSettings,
    options: PlanOptions | None = None,
    stats: SearchStats | None = None,
) -> dict[str, Plan]:
    """Holmes' plan and the alternatives under the same cost model, keyed by name.

    "uniform": Holmes' layout with equal layers per stage. "nic_unaware": Megatron-LM's rank order, uniform
    partition, at Holmes' degrees and micro-batches (and on TCP sockets when IB and RoCE share the job).
    "flat_fsdp": one sharding group over all ranks. "homogeneous": Holmes on the same machines with every link at
    the fastest NIC's speed, the limit. An infeasible alternative is left out and named in Holmes' notes.
    `stats`: filled with what the search for Holmes' plan did.
    """
    options = options or PlanOptions()
    holmes = plan(topology, profile, batch, options, stats)
    same_shape = replace(options, pp=holmes.pp, dp=holmes.dp)
    fixed_batch = replace(batch, microbatches=holmes.microbatches)
    requests = {
        "uniform": (topology, fixed_batch, replace(same_shape, partition="uniform")),
        "nic_unaware": (topology, fixed_batch, replace(same_shape, layout="nic_unaware", partition="uniform")),
        "flat_fsdp": (
            topology,
            batch,
            replace(options, layout="flat_fsdp", sharding=Sharding.fsdp, partition="auto", pp=None, dp=None),
        ),
        "homogeneous": (topology.homogeneous(), batch, options),
    }
    plans, skipped = {}, []
    for name, (hardware, settings, alternative) in requests.items():
        try:
            plans[name] = plan(hardware, profile, settings, alternative)
        except PlanError as err:
            skipped.append(f"alternative {name} is infeasible: {str(err).splitlines()[-1].strip()}")
    return {"holmes": replace(holmes, notes=holmes.notes + tuple(skipped)), **plans}


def _check_request(profile: ModelProfile, batch: BatchSettings, options: PlanOptions) -> None:
    """Settings that are wrong whatever the hardware."""
    checks = [
        (options.schedule in SCHEDULES, "strategy.schedule", options.schedule, f"use one of {', '.join(SCHEDULES)}"),
        (options.layout in LAYOUTS, "layout", options.layout, f"use one of {', '.join(LAYOUTS)}"),
        (options.sharding in SHARDINGS, "strategy.sharding", options.sharding, f"use one of {', '.join(SHARDINGS)}"),
        (options.backend in BACKENDS, "strategy.backend", options.backend, f"use one of {', '.join(BACKENDS)}"),
        (batch.global_batch > 0, "data.global_batch", batch.global_batch, "use a positive number of samples"),
        (batch.microbatches is None or batch.microbatches > 0, "strategy.microbatches", batch.microbatches, "use > 0"),
        (options.pp is None or options.pp > 0, "strategy.pp", options.pp, "use a positive stage count or null"),
        (options.dp is None or options.dp > 0, "strategy.dp", options.dp, "use a positive DP size or null"),
        (options.chunks_per_stage >= 1, "strategy.chunks_per_stage", options.chunks_per_stage, "use >= 2"),
        (0 < options.efficiency <= 1, "strategy.efficiency", options.efficiency, "use a fraction of peak in (0, 1]"),
        (0 <= options.dp_overlap <= 1, "strategy.dp_overlap", options.dp_overlap, "use a fraction in [0, 1]"),
        (options.layer_overhead_s >= 0, "strategy.layer_overhead_s", options.layer_overhead_s, "use seconds >= 0"),
        (options.optimizer_s_per_gb >= 0, "strategy.optimizer_s_per_gb", options.optimizer_s_per_gb, "use s >= 0"),
        (options.latency_s >= 0, "strategy.latency_s", options.latency_s, "use seconds >= 0"),
        (options.fsdp_layer_s >= 0, "strategy.fsdp_layer_s", options.fsdp_layer_s, "use seconds >= 0"),
        (
            options.fsdp_reshard_layer_s >= 0,
            "strategy.fsdp_reshard_layer_s",
            options.fsdp_reshard_layer_s,
            "use seconds >= 0",
        ),
        (
            options.fsdp_optimizer_layer_s >= 0,
            "strategy.fsdp_optimizer_layer_s",
            options.fsdp_optimizer_layer_s,
            "use seconds >= 0",
        ),
        (options.state_multiplier >= 1, "strategy.state_multiplier", options.state_multiplier, "use >= 1 (4: Adam)"),
        (
            options.memory_limit_gb is None or options.memory_limit_gb > 0,
            "strategy.memory_limit_gb",
            options.memory_limit_gb,
            "use the device memory in GB, or null",
        ),
        (
            options.shared_cores is None or options.shared_cores > 0,
            "strategy.shared_cores",
            options.shared_cores,
            "use the machine's core count, or null (a device per rank)",
        ),
        (options.closing_s is None or options.closing_s >= 0, "strategy.closing_s", options.closing_s, "use >= 0"),
        (options.message_cpu_s >= 0, "strategy.message_cpu_s", options.message_cpu_s, "use CPU seconds >= 0"),
    ]
    for ok, name, value, fix in checks:
        if not ok:
            raise PlanError(f"{name}={value!r} is invalid; {fix}")
    partition = options.partition
    if isinstance(partition, str):
        if partition not in ("auto", "uniform"):
            raise PlanError(f"strategy.partition={partition!r}: use auto, uniform, or a list of layers per stage")
    elif sum(partition) != profile.num_layers or min(partition) < 1:
        raise PlanError(
            f"strategy.partition={list(partition)}: must give every stage >= 1 layer and sum to the model's "
            f"{profile.num_layers} layers (embedding + blocks + head); it sums to {sum(partition)}"
        )


def _layouts(topology: Topology, options: PlanOptions, profile: ModelProfile, problems: list[str]) -> list[Layout]:
    """Candidate layouts at the requested (or every valid) pipeline and DP degree.

    Degrees with more (virtual) stages than the model has layers are not built (a 4,096-stage layout costs time);
    why goes to `problems`.
    """
    world = topology.world_size

    def deep_enough(dp: int) -> bool:
        problem = _too_deep(world // dp, options.chunks, profile)
        if problem:
            problems.append(problem)
        return problem is None

    if options.layout == "flat_fsdp":
        return [flat_layout(topology)]
    pp, dp = options.pp, options.dp
    if pp is not None and dp is not None and pp * dp != world:
        raise PlanError(f"strategy.pp={pp} x strategy.dp={dp} = {pp * dp} ranks, but {topology.name!r} has {world}")
    if pp is not None and world % pp:
        raise PlanError(f"strategy.pp={pp} does not divide the {world} ranks of {topology.name!r}; use a divisor")
    wanted = dp if dp is not None else (world // pp if pp is not None else None)
    if options.layout == "nic_unaware":
        sizes = [wanted] if wanted else [d for d in range(1, world + 1) if world % d == 0]
        return [megatron_layout(topology, world // d, d) for d in sizes if deep_enough(d)]
    valid = dp_degrees(topology)
    if wanted is not None and wanted not in valid:
        groups = ", ".join(f"{g.cluster}/{g.nic.value}: {len(g.ranks)}" for g in topology.nic_groups())
        setting = f"strategy.dp={wanted}" if dp is not None else f"strategy.pp={pp} (dp={wanted})"
        raise PlanError(
            f"{setting}: every stage must hold one NIC kind and the same DP size, but the NIC groups ({groups} ranks) "
            f"do not split into stages of {wanted}; use dp in {valid} (pp in {[world // d for d in valid]})"
        )
    orders = group_orders(topology)
    return [holmes_layout(order, d) for d in ([wanted] if wanted else valid) if deep_enough(d) for order in orders]


def _too_deep(pp: int, chunks: int, profile: ModelProfile) -> str | None:
    """Why `pp` stages of `chunks` chunks cannot each get a layer, or None."""
    if pp * chunks <= profile.num_layers:
        return None
    return (
        f"pp={pp} stages x {chunks} chunk(s) need {pp * chunks} layers but {profile.name!r} has "
        f"{profile.num_layers}; use fewer stages (strategy.pp) or fewer chunks (strategy.chunks_per_stage)"
    )


def _partition_fits(options: PlanOptions, pp: int) -> bool:
    """An explicit partition lists one count per stage, or per virtual stage when interleaving."""
    return isinstance(options.partition, str) or len(options.partition) in (pp, pp * options.chunks)


def _microbatch_counts(
    layout: Layout, profile: ModelProfile, batch: BatchSettings, options: PlanOptions, problems: list[str]
) -> list[int]:
    """Micro-batch counts worth evaluating for this layout; reasons for rejecting it go to `problems`."""
    pp, dp = layout.pp, layout.dp
    problem = _too_deep(pp, options.chunks, profile)
    if problem:
        problems.append(problem)
        return []
    if not _partition_fits(options, pp):
        problems.append(
            f"strategy.partition={list(options.partition)} lists {len(options.partition)} stages but the plan has "
            f"pp={pp}; give {pp} counts (or set strategy.pp={len(options.partition)})"
        )
        return []
    if batch.global_batch % dp:
        problems.append(
            f"data.global_batch={batch.global_batch} does not split over dp={dp} ranks; use a multiple of {dp}"
        )
        return []
    per_rank = batch.global_batch // dp
    if pp * options.chunks == 1:  # no pipeline: the module's own training_step takes each replica batch in one pass
        if batch.microbatches in (None, 1):
            return [1]
        problems.append(
            f"strategy.microbatches={batch.microbatches}: without a pipeline (pp=1, one chunk) a step runs its "
            f"{per_rank} samples per DP rank in one pass; use microbatches=1 (or null), or Lightning's "
            f"accumulate_grad_batches"
        )
        return []
    if batch.microbatches is not None:
        counts = [batch.microbatches]
        if per_rank % batch.microbatches:
            divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
            problems.append(
                f"strategy.microbatches={batch.microbatches} does not divide the {per_rank} samples per DP rank "
                f"(data.global_batch={batch.global_batch} / dp={dp}); use one of {divisors}"
            )
            return []
    else:
        counts = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    fitting = [m for m in counts if microbatch_problem(options.schedule, pp, m) is None]
    if not fitting:
        problems.append(
            f"{microbatch_problem(options.schedule, pp, max(counts))} (data.global_batch={batch.global_batch} gives "
            f"{per_rank} samples per DP rank); raise data.global_batch or strategy.microbatches, use fewer stages, "
            f"or schedule GPipe"
        )
    return fitting


def _notes(layout: Layout, stages: list[StagePlan]) -> tuple[str, ...]:
    notes = []
    if not layout.rdma:
        notes.append("IB and RoCE share this job's communicators, so every one of them runs on TCP sockets")
    mixed = [s.index for s in stages if s.mixes_fabrics]
    if mixed:
        notes.append(f"stages {mixed} mix clusters or NIC kinds inside one DP group")
    return tuple(notes)
