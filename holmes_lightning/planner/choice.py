"""`best_plan()`: the Holmes scheduler. Picks degrees, a NIC-aware rank layout, a partition and micro-batches; and
`compare_plans()`: the alternatives it is measured against, under the same cost model."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from holmes_lightning.planner.bounds import SuffixBounds
from holmes_lightning.planner.candidate import GB, Candidate, RangeCosts, predict_step
from holmes_lightning.planner.cost import CostModel, MachineCosts, sync_bytes
from holmes_lightning.planner.cuts import CriticalPaths
from holmes_lightning.planner.glue import JoinedProfile
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
from holmes_lightning.planner.options import (
    MODELLED_SCHEDULES,
    Backend,
    BatchSettings,
    Checkpointing,
    LayoutKind,
    PartitionRule,
    PlanOptions,
    Schedule,
    Sharding,
)
from holmes_lightning.planner.partition import split_chunks, uniform_partition
from holmes_lightning.planner.plan_types import Plan, StagePlan
from holmes_lightning.planner.profile import ModelProfile
from holmes_lightning.planner.schedules import microbatch_problem
from holmes_lightning.planner.search import Found, SearchStats, search
from holmes_lightning.topology import Topology

STEP_TOLERANCE = 0.02  # plans predicted this much slower than the fastest count as fast: the least memory wins
MEMORY_RESOLUTION = 0.01  # the least memory is found to this share of the fastest plan's peak


class PlanError(ValueError):
    """No plan satisfies the request on this hardware and model; the message names the setting, its value and a fix."""


def cost_model(
    topology: Topology, profile: ModelProfile, *, options: PlanOptions, costs: MachineCosts, sharding: Sharding
) -> CostModel:
    """The cost model of plans of this `sharding` for `options` on a machine that costs `costs`."""
    return CostModel(
        topology,
        profile,
        costs,
        sharding,
        options.state_multiplier,
        backend=options.backend,
    )


def best_plan(
    topology: Topology,
    profile: ModelProfile,
    batch: BatchSettings,
    *,
    options: PlanOptions | None = None,
    costs: MachineCosts | None = None,
    stats: SearchStats | None = None,
) -> Plan:
    """The plan with the lowest simulated step among every one the options allow, on a machine that costs `costs`
    (None: `MachineCosts()`, assumed); `stats`: filled with what the search did.

    Candidates are every layout (NIC group order and DP size), micro-batch count and sharding the options allow;
    `search.search` finds the best split of each that could beat the best so far. Ties go to FSDP, then fewer DP
    ranks, config order, fewer micro-batches. Of the plans predicted within `STEP_TOLERANCE` of the fastest, the one
    taking the least memory per device wins (`_least_memory`). With `partition=auto`, stages start only at layers
    with parameters (`glue.JoinedProfile`).
    """
    options = options or PlanOptions()
    joined = JoinedProfile.of(profile) if options.partition is PartitionRule.auto else None
    if joined is not None:  # no stage may hold only parameterless layers
        return joined.expand(best_plan(topology, joined.profile, batch, options=options, costs=costs, stats=stats))
    costs = costs or MachineCosts()
    _check_partition(profile, options)
    stats = stats if stats is not None else SearchStats()
    if options.schedule.chosen:
        return _best_schedule(topology, profile, batch, options=options, costs=costs, stats=stats)
    problems: list[str] = []
    limit, bound = _memory_bound(options, costs)
    layouts = _layouts(topology, options, profile, problems)
    known: dict[tuple, Any] = {}
    hardware = [StageHardware.of(topology, layout, known) for layout in layouts]
    stats.layouts += len(layouts)
    shardings = (Sharding.fsdp, Sharding.none) if options.sharding is Sharding.auto else (options.sharding,)
    settings = []
    for i, sharding in enumerate(shardings):  # FSDP first: replicas win only when strictly faster
        cost = cost_model(topology, profile, options=options, costs=costs, sharding=sharding)
        for j, (layout, stage_hardware) in enumerate(zip(layouts, hardware, strict=True)):
            if options.sharding is Sharding.auto and _dominated(sharding, layout, options, costs):
                continue
            for k, microbatches in enumerate(_microbatch_counts(layout, profile, batch, options, problems)):
                settings.append(((i, j, k), layout, stage_hardware, replace(cost, rdma=layout.rdma), microbatches))
    checkpointing = checkpointing_choices(options, limited=limit is not None)

    shared: dict[tuple, RangeCosts] = {}

    def candidates(
        ceiling: float | None, only: Callable[[tuple[int, ...]], bool] = lambda _: True
    ) -> list[tuple[tuple[int, ...], Candidate]]:
        """The candidates whose preference is `only`, a stage's memory at most `ceiling` (None: the limit alone)."""
        listed = []
        for preference, layout, stage_hardware, cost, microbatches in filter(lambda s: only(s[0]), settings):
            microbatch_size = batch.global_batch // layout.dp // microbatches
            candidate = Candidate(
                layout=layout,
                hardware=stage_hardware,
                cost=cost,
                schedule=options.schedule,
                chunks=options.chunks,
                microbatches=microbatches,
                microbatch_size=microbatch_size,
                memory_limit=limit,
                range_costs=shared.setdefault((cost.sharding, microbatch_size), RangeCosts()),
                checkpointing=checkpointing,
                memory_ceiling=ceiling,
            )
            listed.append((preference, candidate))
        return listed

    def infeasible(candidate: Candidate, counts: tuple[int, ...] | None) -> None:
        problems.append(_memory_problem(candidate, counts, bound))

    def fixed(candidate: Candidate) -> tuple[int, ...] | None:
        return _fixed_counts(options, candidate)

    lower: dict[tuple[int, ...], float] = {}
    tables: dict[tuple[int, ...], SuffixBounds] = {}
    paths: dict[tuple, CriticalPaths] = {}
    descended: list[Found] = []
    fastest = search(
        candidates(None),
        fixed,
        stats,
        infeasible,
        lower=lower,
        slack=STEP_TOLERANCE,
        tables=tables,
        paths=paths,
        descended=descended,
    )
    if fastest is None:
        reasons = "\n  ".join(dict.fromkeys(problems)) or "no layout fits"
        raise PlanError(f"no feasible plan for {topology.name!r} and {profile.name!r}:\n  {reasons}")
    slowest = fastest.step_s * (1 + STEP_TOLERANCE)
    chosen = _least_memory(
        fastest,
        min([fastest, *(seed for seed in descended if seed.step_s < slowest)], key=_peak_bytes),
        lambda ceiling: candidates(ceiling, lambda p: lower[p] < slowest),
        fixed,
        stats,
        tables,
        paths,
    )
    more = () if chosen is fastest else (_memory_note(chosen, fastest),)
    return _as_plan(chosen.candidate, chosen.counts, options, bound, more)


def _best_schedule(
    topology: Topology,
    profile: ModelProfile,
    batch: BatchSettings,
    *,
    options: PlanOptions,
    costs: MachineCosts,
    stats: SearchStats,
) -> Plan:
    """`schedule=auto`: the best plan of each modelled schedule, and of those the one with the fastest predicted step
    (of plans within `STEP_TOLERANCE` of it, the least memory; ties in `MODELLED_SCHEDULES` order). Its notes list
    every schedule's predicted step and bubble."""
    plans: dict[Schedule, Plan] = {}
    problems: list[str] = []
    for schedule in MODELLED_SCHEDULES:
        try:
            plans[schedule] = best_plan(
                topology, profile, batch, options=replace(options, schedule=schedule), costs=costs, stats=stats
            )
        except PlanError as error:
            problems.append(f"{schedule.value}: {str(error).splitlines()[-1].strip()}")
    if not plans:
        reasons = "\n  ".join(problems)
        raise PlanError(f"no feasible plan for {topology.name!r} and {profile.name!r} with any schedule:\n  {reasons}")
    fastest = min(plan.prediction.total_s for plan in plans.values())
    fast = [plan for plan in plans.values() if plan.prediction.total_s <= fastest * (1 + STEP_TOLERANCE)]
    chosen = min(fast, key=lambda plan: plan.prediction.memory_gb)
    compared = tuple(
        f"schedule {schedule.value}: step {plan.prediction.total_s:.4g} s, bubble {plan.prediction.bubble_s:.3g} s, "
        f"{plan.prediction.memory_gb:.3g} GB/GPU, pp={plan.pp} x dp={plan.dp}, {plan.microbatches} micro-batches"
        + (" (chosen)" if plan is chosen else "")
        for schedule, plan in plans.items()
    )
    unplanned = tuple(f"schedule {problem}" for problem in problems)
    return replace(chosen, notes=chosen.notes + ("schedule auto, by predicted step:",) + compared + unplanned)


def _least_memory(
    fastest: Found,
    start: Found,
    candidates: Callable[[float], list[tuple[tuple[int, ...], Candidate]]],
    fixed: Callable[[Candidate], tuple[int, ...] | None],
    stats: SearchStats,
    tables: dict[tuple[int, ...], SuffixBounds],
    paths: dict[tuple, CriticalPaths],
) -> Found:
    """Of the plans predicted within `STEP_TOLERANCE` of `fastest`, one taking the least peak memory per device (to
    `MEMORY_RESOLUTION` of `fastest`'s): one search for any plan that fast under a memory ceiling just below
    `start`'s peak (a plan that fast: `fastest`, or a descended seed that takes less memory), each plan it finds
    lowering the ceiling to just below its own, the search going on under it.
    `candidates(ceiling)`: those that may have a plan that fast (their bound from the first search says so), under
    that ceiling; `tables`: the first search's suffix tables, per preference; `paths`: its critical paths, per
    schedule order.

    The ceiling never turns on more activation checkpointing than the memory limit needs; it only rules plans out.
    """
    step = MEMORY_RESOLUTION * _peak_bytes(fastest)
    stats.memory_searches += 1
    apart = SearchStats.reporting(stats.partitions.report, stats.partitions.report_every_s)  # counted apart
    found = search(
        candidates(_peak_bytes(start) - step),
        fixed,
        apart,
        lambda *_: None,
        ceiling=fastest.step_s * (1 + STEP_TOLERANCE),
        tables=tables,
        paths=paths,
        lowering=step,
    )
    return start if found is None else found


def _peak_bytes(found: Found) -> float:
    return found.candidate.peak_bytes(found.counts)


def _memory_note(chosen: Found, fastest: Found) -> str:
    return (
        f"chosen for memory: {_peak_bytes(chosen) / GB:.3g} GB per device instead of the fastest plan's "
        f"{_peak_bytes(fastest) / GB:.3g} GB, for a step {chosen.step_s / fastest.step_s - 1:.1%} longer (plans within "
        f"{STEP_TOLERANCE:.0%} of the fastest count as fast)"
    )


def checkpointing_choices(options: PlanOptions, *, limited: bool) -> tuple[Checkpointing, ...]:
    """The activation checkpointing a stage may run, cheapest first (each stage takes the first that fits): `auto`
    adds selective and full only under a memory limit (without one, keeping activations is never slower)."""
    if options.activation_checkpointing is not Checkpointing.auto:
        return (options.activation_checkpointing,)
    if not limited:
        return (Checkpointing.off,)
    return (Checkpointing.off, Checkpointing.selective, Checkpointing.full)


def _dominated(sharding: Sharding, layout: Layout, options: PlanOptions, costs: MachineCosts) -> bool:
    """A sharding the other one is never slower than on this layout, so `auto` need not try it.

    One rank per stage: nothing to shard (the runtime leaves such groups plain), equal costs: replicas. In a pipeline
    on NCCL whose hooks and messages cost nothing extra, FSDP's all-gather + reduce-scatter move what an all-reduce
    moves, and its optimizer step and memory are smaller: FSDP. (Without a pipeline FSDP gathers twice.)
    """
    if layout.dp == 1:
        return sharding is Sharding.fsdp
    pipelined = layout.pp * options.chunks > 1
    return options.backend is Backend.nccl and pipelined and costs.free_hooks and sharding is Sharding.none


def _memory_bound(options: PlanOptions, costs: MachineCosts) -> tuple[float | None, str]:
    """The bytes a plan may take per device, and that limit in words: the user's `memory_limit_gb` or what the
    device has for training (`costs.device_memory_gb`), the smaller; None: unbounded."""
    bounds = []
    if options.memory_limit_gb is not None:
        bounds.append((options.memory_limit_gb, f"memory_limit_gb={options.memory_limit_gb}"))
    if costs.device_memory_gb is not None:
        device = costs.device_memory_gb
        bounds.append((device, f"the device's {device:.3g} GB for training (its memory less a reserve)"))
    if not bounds:
        return None, ""
    gb, words = min(bounds)
    return gb * GB, words


def _memory_problem(candidate: Candidate, counts: tuple[int, ...] | None, bound: str) -> str:
    """Why a candidate's split (None: every split) does not fit the memory `bound`, and what to change."""
    fix = "use more stages (pp) or micro-batches (microbatches), or a larger limit"
    fix += ", or sharding=fsdp" if candidate.cost.sharding is not Sharding.fsdp else ""
    if counts is None:
        return (
            f"no partition of {candidate.cost.profile.name!r} over pp={candidate.layout.pp} with "
            f"{candidate.microbatches} micro-batches fits {bound} per device; {fix}"
        )
    worst = max(candidate.stage_plans(counts), key=lambda stage: stage.memory_gb)
    return (
        f"stage {worst.index} (ranks {list(worst.ranks)}) needs about {worst.memory_gb:.1f} GB per device, above "
        f"{bound}; {fix}"
    )


def _fixed_counts(options: PlanOptions, candidate: Candidate) -> tuple[int, ...] | None:
    """Layers per virtual stage of a uniform or explicit partition (None: `auto`, searched)."""
    num_layers, pp, chunks = candidate.num_layers, candidate.layout.pp, candidate.chunks
    if options.partition is PartitionRule.auto:
        return None
    if options.partition is PartitionRule.uniform:
        return uniform_partition(num_layers, pp * chunks)
    counts = options.partition
    return counts if len(counts) == pp * chunks else split_chunks(counts, candidate.located)


def _as_plan(
    candidate: Candidate, counts: tuple[int, ...], options: PlanOptions, bound: str, more: tuple[str, ...] = ()
) -> Plan:
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
        notes=_notes(layout, stages, options, bound) + more,
        partition=options.partition.value if isinstance(options.partition, PartitionRule) else "explicit",
        sharding=candidate.cost.sharding,
        tokens_per_sample=candidate.cost.profile.tokens_per_sample,
        rdma=layout.rdma,
        pp_links=pipeline_links(candidate.cost.topology, layout),
        shared_cores=candidate.cost.machine.shared_cores,
        backend=candidate.cost.backend,
    )


def on_shared_cores(
    planned: Plan, profile: ModelProfile, *, cores: float, share: float, transfer_cpu_s_per_byte: float = 0.0
) -> Plan:
    """`planned` (planned for a device per rank, each computing at `share` of one of these cores) as it runs with every
    rank on `cores` CPU cores of one machine: the same layout, its passes at their speed alone while no more ranks than
    cores compute (`planner.sharing`), predicted again.

    `transfer_cpu_s_per_byte`: what moving a byte between two ranks costs the cores (sender, receiver and the kernel
    between them). A pipeline message's cost joins the pass that sends it, so it slows the ranks computing beside it;
    the DP sync's, every rank's at once, lengthens each stage's exposed sync by all of it spread over the cores.
    """
    cpu = transfer_cpu_s_per_byte
    out_bytes = [layer.activation_bytes * planned.microbatch_size for layer in profile.layers]
    last = profile.num_layers
    moved = sum(  # every rank of every group syncs at once
        len(stage.ranks)
        * sync_bytes(
            planned.sharding,
            planned.backend,
            len(stage.ranks),
            sum(profile.layers[i].param_bytes for i in stage.layers),
            pipelined=planned.is_pipelined,
            frozen_bytes=sum(profile.layers[i].frozen_bytes for i in stage.layers),
        )
        for stage in planned.stages
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
            weight_s=tuple(seconds * share for seconds in stage.weight_s),  # the message joins the input pass
            exposed_sync_s=stage.exposed_sync_s + (sync_cpu_s if len(stage.ranks) > 1 else 0.0),
        )
        for stage in planned.stages
    )
    prediction = predict_step(
        stages,
        schedule=planned.schedule,
        microbatches=planned.microbatches,
        microbatch_size=planned.microbatch_size,
        profile=profile,
        shared_cores=cores,
        backend=planned.backend,
    )
    return replace(planned, stages=stages, prediction=prediction, shared_cores=cores)


def best_plan_per_replica(
    topology: Topology,
    profile: ModelProfile,
    replica_batch: int,
    *,
    options: PlanOptions | None = None,
    costs: MachineCosts | None = None,
    stats: SearchStats | None = None,
) -> Plan:
    """The best plan when each DP replica takes `replica_batch` samples per step, as a DataLoader of that batch size
    does under DDP (the global batch is then `replica_batch` x dp): the one of most tokens per second over the DP
    degrees the options allow, each planned by `best_plan` (`stats`: filled with what all the searches did)."""
    options = options or PlanOptions()
    if options.dp is not None:
        degrees = [options.dp]
    elif options.layout is LayoutKind.flat_fsdp:
        degrees = [topology.world_size]
    else:
        degrees = dp_degrees(topology)
    plans, problems = [], []
    for dp in degrees:
        batch = BatchSettings(replica_batch * dp)
        try:
            plans.append(best_plan(topology, profile, batch, options=replace(options, dp=dp), costs=costs, stats=stats))
        except PlanError as error:
            problems.append(f"dp={dp} (global batch {batch.global_batch}): {str(error).splitlines()[-1].strip()}")
    if not plans:
        reasons = "\n  ".join(problems)
        raise PlanError(f"no feasible plan for {replica_batch} samples per DP replica per step:\n  {reasons}")
    return max(plans, key=lambda plan: plan.prediction.tokens_per_s)


def compare_plans(
    topology: Topology,
    profile: ModelProfile,
    batch: BatchSettings,
    *,
    options: PlanOptions | None = None,
    costs: MachineCosts | None = None,
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
    holmes = best_plan(topology, profile, batch, options=options, costs=costs, stats=stats)
    same_shape = replace(options, pp=holmes.pp, dp=holmes.dp)
    fixed_batch = replace(batch, microbatches=holmes.microbatches)
    requests = {
        "uniform": (topology, fixed_batch, replace(same_shape, partition=PartitionRule.uniform)),
        "nic_unaware": (
            topology,
            fixed_batch,
            replace(same_shape, layout=LayoutKind.nic_unaware, partition=PartitionRule.uniform),
        ),
        "flat_fsdp": (
            topology,
            batch,
            replace(
                options,
                layout=LayoutKind.flat_fsdp,
                sharding=Sharding.fsdp,
                partition=PartitionRule.auto,
                pp=None,
                dp=None,
            ),
        ),
        "homogeneous": (topology.homogeneous(), batch, options),
    }
    plans, skipped = {}, []
    for name, (hardware, settings, alternative) in requests.items():
        try:
            plans[name] = best_plan(hardware, profile, settings, options=alternative, costs=costs)
        except PlanError as err:
            skipped.append(f"alternative {name} is infeasible: {str(err).splitlines()[-1].strip()}")
    return {"holmes": replace(holmes, notes=holmes.notes + tuple(skipped)), **plans}


def _check_partition(profile: ModelProfile, options: PlanOptions) -> None:
    """An explicit partition must cover this model's layers."""
    partition = options.partition
    if not isinstance(partition, PartitionRule) and sum(partition) != profile.num_layers:
        raise PlanError(
            f"partition={list(partition)}: must sum to the model's {profile.num_layers} layers (every pipeline "
            f"layer once); it sums to {sum(partition)}"
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

    if options.layout is LayoutKind.flat_fsdp:
        return [flat_layout(topology)]
    sizes = _allowed_dp(topology, options)
    if options.layout is LayoutKind.nic_unaware:
        return [megatron_layout(topology, world // d, d) for d in sizes if deep_enough(d)]
    orders = group_orders(topology)
    return [holmes_layout(order, d) for d in sizes if deep_enough(d) for order in orders]


def _allowed_dp(topology: Topology, options: PlanOptions) -> list[int]:
    """The DP degrees a request allows: every rank for flat FSDP, the requested one, else every one its layout
    takes (any divisor of the ranks for a NIC-unaware layout)."""
    world = topology.world_size
    if options.layout is LayoutKind.flat_fsdp:
        return [world]
    wanted = check_degrees(topology, options)
    if wanted:
        return [wanted]
    if options.layout is LayoutKind.nic_unaware:
        return [d for d in range(1, world + 1) if world % d == 0]
    return dp_degrees(topology)


def check_degrees(topology: Topology, options: PlanOptions) -> int | None:
    """The DP degree that the requested pp or dp fixes on `topology` (None: not fixed), or a PlanError naming the
    degree no layout of it takes. It needs no model, so a launch checks it before any process starts."""
    if options.layout is LayoutKind.flat_fsdp:
        return None
    world, pp, dp = topology.world_size, options.pp, options.dp
    if pp is not None and dp is not None and pp * dp != world:
        raise PlanError(f"pp={pp} x dp={dp} = {pp * dp} ranks, but {topology.name!r} has {world}")
    if pp is not None and world % pp:
        raise PlanError(f"pp={pp} does not divide the {world} ranks of {topology.name!r}; use a divisor")
    wanted = dp if dp is not None else (world // pp if pp is not None else None)
    if options.layout is not LayoutKind.holmes or wanted is None:
        return wanted
    valid = dp_degrees(topology)
    if wanted not in valid:
        groups = ", ".join(f"{g.cluster}/{g.nic.value}: {len(g.ranks)}" for g in topology.nic_groups())
        setting = f"dp={wanted}" if dp is not None else f"pp={pp} (dp={wanted})"
        raise PlanError(
            f"{setting}: every stage must hold one NIC kind and the same DP size, but the NIC groups ({groups} ranks) "
            f"do not split into stages of {wanted}; use dp in {valid} (pp in {[world // d for d in valid]})"
        )
    return wanted


def check_batch(topology: Topology, options: PlanOptions, batch: BatchSettings) -> None:
    """A PlanError where no DP degree that the request allows splits `batch` into micro-batches a schedule it allows
    takes (the reasons per degree). It needs no model, so a launch checks it before any process starts."""
    world = topology.world_size
    schedules = MODELLED_SCHEDULES if options.schedule.chosen else (options.schedule,)
    problems: list[str] = []
    for dp, schedule in itertools.product(_allowed_dp(topology, options), schedules):
        pp = 1 if options.layout is LayoutKind.flat_fsdp else world // dp
        if _batch_splits(pp, dp, batch, replace(options, schedule=schedule), problems):
            return
    reasons = "\n  ".join(dict.fromkeys(problems))
    raise PlanError(f"no plan for {topology.name!r} splits global_batch={batch.global_batch}:\n  {reasons}")


def _too_deep(pp: int, chunks: int, profile: ModelProfile) -> str | None:
    """Why `pp` stages of `chunks` chunks cannot each get a layer, or None."""
    if pp * chunks <= profile.num_layers:
        return None
    return (
        f"pp={pp} stages x {chunks} chunk(s) need {pp * chunks} layers but {profile.name!r} has "
        f"{profile.num_layers}; use fewer stages (pp) or fewer chunks (chunks_per_stage)"
    )


def _partition_fits(options: PlanOptions, pp: int) -> bool:
    """An explicit partition lists one count per stage, or per virtual stage when interleaving."""
    return isinstance(options.partition, PartitionRule) or len(options.partition) in (pp, pp * options.chunks)


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
            f"partition={list(options.partition)} lists {len(options.partition)} stages but the plan has "
            f"pp={pp}; give {pp} counts (or set pp={len(options.partition)})"
        )
        return []
    return _batch_splits(pp, dp, batch, options, problems)


def _batch_splits(pp: int, dp: int, batch: BatchSettings, options: PlanOptions, problems: list[str]) -> list[int]:
    """The micro-batch counts that split the global batch's share of each of `dp` replicas and that the schedule
    takes on `pp` stages; reasons for none go to `problems`. Needs no model."""
    if batch.global_batch % dp:
        problems.append(f"global_batch={batch.global_batch} does not split over dp={dp} ranks; use a multiple of {dp}")
        return []
    per_rank = batch.global_batch // dp
    if pp * options.chunks == 1:  # no pipeline: the module's own training_step takes each replica batch in one pass
        if batch.microbatches in (None, 1):
            return [1]
        problems.append(
            f"microbatches={batch.microbatches}: without a pipeline (pp=1, one chunk) a step runs its "
            f"{per_rank} samples per DP rank in one pass; use microbatches=1 (or null), or Lightning's "
            f"accumulate_grad_batches"
        )
        return []
    if batch.microbatches is not None:
        counts = [batch.microbatches]
        if per_rank % batch.microbatches:
            divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
            problems.append(
                f"microbatches={batch.microbatches} does not divide the {per_rank} samples per DP rank "
                f"(global_batch={batch.global_batch} / dp={dp}); use one of {divisors}"
            )
            return []
    else:
        counts = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    fitting = [m for m in counts if microbatch_problem(options.schedule, pp, m) is None]
    if not fitting:
        problems.append(
            f"{microbatch_problem(options.schedule, pp, max(counts))} (global_batch={batch.global_batch} gives "
            f"{per_rank} samples per DP rank); raise global_batch or microbatches, use fewer stages, "
            f"or schedule GPipe"
        )
    return fitting


def _notes(layout: Layout, stages: list[StagePlan], options: PlanOptions, bound: str) -> tuple[str, ...]:
    notes = []
    turned: dict[Checkpointing, list[int]] = {}
    for stage in stages:
        if stage.checkpointing is not Checkpointing.off:
            turned.setdefault(stage.checkpointing, []).append(stage.index)
    if options.activation_checkpointing is Checkpointing.auto and turned:
        where = "; ".join(f"{mode} on stages {indices}" for mode, indices in turned.items())
        notes.append(f"activation checkpointing turned on where keeping every activation exceeds {bound}: {where}")
    if not layout.rdma:
        notes.append("IB and RoCE share this job's communicators, so every one of them runs on TCP sockets")
    mixed = [s.index for s in stages if s.mixes_fabrics]
    if mixed:
        notes.append(f"stages {mixed} mix clusters or NIC kinds inside one DP group")
    return tuple(notes)
