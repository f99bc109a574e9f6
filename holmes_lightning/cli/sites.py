"""train.py across sites: whether the job runs one pipeline over every cluster or DiLoCo over sites
(`strategy.cross_site`), and where each site keeps its checkpoints."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import holmes_lightning.runtime.checkpoint as checkpoint
from holmes_lightning.cli.config import ConfigError, CrossSite, TrainConfig
from holmes_lightning.planner import (
    BatchSettings,
    MachineCosts,
    ModelProfile,
    Plan,
    PlanError,
    PlanOptions,
    best_plan,
)
from holmes_lightning.planner.sites import (
    Grouping,
    diloco_options,
    find_grouping,
    grouping_label,
    predict_diloco,
    site_batches,
    site_options,
    site_topology,
)
from holmes_lightning.topology import Topology

PROFILE_BYTES_PER_VALUE = 2  # the profiles' parameter bytes are counted in bf16 (`ModelProfile.from_gpt`)


def choose_sites(
    config: TrainConfig,
    topology: Topology,
    pipeline: Plan | None,
    profile: ModelProfile | None,
    *,
    batch: BatchSettings | None,
    options: PlanOptions,
    costs: MachineCosts,
) -> Grouping | None:
    """The sites to run DiLoCo over, or None for one pipeline; `auto` says why on stdout."""
    mode = config.strategy.cross_site
    if mode is CrossSite.pipeline:
        return None
    try:
        grouping = find_grouping(topology, config.diloco.sites)
    except PlanError as error:
        if mode is CrossSite.diloco or config.diloco.sites is not None:
            raise ConfigError(f"strategy.cross_site={mode} (diloco.sites={config.diloco.sites}): {error}") from None
        return None
    if mode is CrossSite.diloco:
        return grouping
    faster, why = _auto_choice(topology, grouping, pipeline, profile, batch, config, options, costs)
    print(f"train.py: strategy.cross_site=auto: {why}", flush=True)
    return grouping if faster else None


def _auto_choice(
    topology: Topology,
    grouping: Grouping,
    pipeline: Plan | None,
    profile: ModelProfile | None,
    batch: BatchSettings | None,
    config: TrainConfig,
    options: PlanOptions,
    costs: MachineCosts,
) -> tuple[bool, str]:
    """Whether DiLoCo over `grouping` wins, and why."""
    if pipeline is None or profile is None or batch is None:
        return False, "one pipeline (your module is profiled once its ranks start, after the launch's shape is set)"
    pipe = batch.global_batch * profile.tokens_per_sample / pipeline.prediction.total_s
    try:
        diloco = predict_diloco(
            topology,
            profile,
            batch,
            grouping,
            parameters=profile.trained_bytes / PROFILE_BYTES_PER_VALUE,
            settings=config.diloco.settings(),
            options=site_options(options),
            costs=costs,
        )
    except PlanError as error:
        return False, f"one pipeline (DiLoCo over {grouping_label(grouping)} cannot plan: {error})"
    faster = diloco.tokens_per_s > pipe
    predicted = f"predicted {pipe:,.0f} tokens/s as one pipeline, {diloco.tokens_per_s:,.0f} with DiLoCo"
    if faster and not config.diloco.allowed:
        opt_in = "DiLoCo changes the optimisation: set diloco.allowed=true to let auto choose it"
        return False, f"one pipeline: {predicted} over {diloco.label}, but diloco.allowed=false ({opt_in})"
    return faster, f"{'DiLoCo over ' + diloco.label if faster else 'one pipeline'}: {predicted}"


def one_plan_for_every_site(
    config: TrainConfig,
    topology: Topology,
    grouping: Grouping,
    profile: ModelProfile,
    *,
    options: PlanOptions,
    costs: MachineCosts,
) -> list[str]:
    """The slowest site's plan (its degrees, layers per stage, sharding and schedule; each site picks its own
    micro-batches) as `strategy.*` overrides every site's ranks run: planned apart, each on its own calibration, the
    sites' plans could differ. Checked first that every site can run it with rank i of every site on the same shards,
    as DiLoCo's outer all-reduce needs; a ConfigError naming each site's plan if not, before any rank starts."""
    batches = site_batches(topology, grouping, config.data.global_batch)
    machines = [site_topology(topology, site) for site in grouping]
    options = diloco_options(options)

    def plans(given: PlanOptions, microbatches: int | None) -> list[Plan]:
        return [
            best_plan(site, profile, BatchSettings(samples, microbatches), options=given, costs=costs)
            for site, samples in zip(machines, batches, strict=True)
        ]

    apart = plans(options, config.strategy.microbatches)
    slowest = max(apart, key=lambda plan: plan.prediction.total_s)
    layers = [stop - start for start, stop in sorted(chunk for stage in slowest.stages for chunk in stage.chunks)]
    pinned = {
        "pp": slowest.pp,
        "dp": slowest.dp,
        "partition": layers,
        "sharding": slowest.sharding,
        "schedule": slowest.schedule,
    }
    try:
        alike = plans(replace(options, **pinned), config.strategy.microbatches)
    except PlanError as error:
        alike, why = [], str(error)
    else:
        why = ""
    shapes = {(plan.sharding, tuple((stage.ranks, stage.chunks) for stage in plan.stages)) for plan in alike}
    if len(shapes) != 1 or len(alike) != len(grouping):
        described = "; ".join(
            f"site {'+'.join(site)}: {plan.pp}x{plan.dp}, layers {'/'.join(map(str, plan.layers_per_stage()))}"
            for site, plan in zip(grouping, apart, strict=True)
        )
        raise ConfigError(
            f"strategy.cross_site=diloco: no one plan fits every site ({described}{'; ' + why if why else ''}); "
            f"DiLoCo averages rank i of every site with the others' rank i, so the sites need as many ranks and one "
            f"plan: group the clusters into other sites (diloco.sites) or pin strategy.pp, strategy.dp and "
            f"strategy.partition"
        )
    return [f"strategy.{name}={list(value) if isinstance(value, list) else value}" for name, value in pinned.items()]


def site_dir(directory: str, label: str) -> str:
    """Where a site keeps its checkpoints: its own folder in `checkpoint.dir` (each site is a job of its own)."""
    return str(Path(directory) / f"site-{label}")


def site_resume(path: str | None, label: str) -> str | None:
    """This site's checkpoint of the step that `path` (one site's checkpoint, `DIR/site-X/step_N.ckpt`) names."""
    return None if path is None else str(Path(site_dir(str(Path(path).parent.parent), label)) / Path(path).name)


def latest_of_every_site(directory: str, grouping: Grouping) -> Path | None:
    """The newest step every site has a complete checkpoint of (as the first site's), or None."""
    folders = [Path(site_dir(directory, "+".join(site))) for site in grouping]
    steps = [set(checkpoint.published(folder)) for folder in folders]
    common = sorted(set.intersection(*steps)) if steps else []
    return folders[0] / common[-1] if common else None
