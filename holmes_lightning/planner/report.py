"""Plain-text views of plans: the rank map, the stages, a side-by-side comparison of alternatives, and of one
pipeline across sites against DiLoCo."""

from __future__ import annotations

from collections.abc import Sequence

from holmes_lightning.planner.plan_types import Plan, StagePlan
from holmes_lightning.planner.profile import ModelProfile
from holmes_lightning.planner.sites import DiLoCoPrediction, DiLoCoSettings


def format_plan(plan: Plan, profile: ModelProfile | None = None) -> str:
    """Rank map, stages with their layers (named after `profile`'s, numbered only without it), groups with NIC kind
    and link speed, and the predicted step."""
    p = plan.prediction
    lines = [
        f"{plan.layout} plan: pp={plan.pp} x dp={plan.dp}, {plan.schedule}, {plan.microbatches} micro-batches of "
        f"{plan.microbatch_size}, {plan.sharding}, partition {plan.partition}",
        "  rank map (row = stage = one DP group; column = dp index):",
    ]
    lines += [f"    stage {stage.index}: {_ranks(stage.ranks)}" for stage in plan.stages]
    held = ["; ".join(_layer_range(profile, start, stop) for start, stop in stage.chunks) for stage in plan.stages]
    wide = max(34, *(len(layers) + 2 for layers in held))  # a stage's chunks may take more than the column
    header = (
        f"  {'stage':<6}{'cluster/nic':<20}{'TFLOPS':>7}  {'layers':<{wide}}{'DP group link':<22}"
        f"{'to next':<17}{'fwd+bwd/mb':>11}{'sync':>9}{'exposed':>9}{'mem GB':>8}  act. checkpointing"
    )
    lines += ["", header]
    for stage, layers in zip(plan.stages, held, strict=True):
        dp_link = f"{stage.dp_link.value} {stage.dp_gbps:g} Gb/s" if len(stage.ranks) > 1 else "-"
        send = (
            f"{stage.send_link.value} {stage.send_gbps:g} Gb/s"
            if stage.send_link and stage.index < plan.pp - 1
            else "-"
        )
        compute = sum(stage.forward_s) + sum(stage.backward_s)
        lines.append(
            f"  {stage.index:<6}{fabric_label(stage):<20}{stage.device_tflops:>7g}  {layers:<{wide}}"
            f"{dp_link:<22}{send:<17}{_ms(compute):>11}{_ms(stage.sync_s):>9}{_ms(stage.exposed_sync_s):>9}"
            f"{stage.memory_gb:>8.1f}  {stage.checkpointing.value}"
        )
    lines += [
        "",
        f"  predicted step {p.total_s:.4g} s = compute {p.compute_s:.4g} + DP sync {p.dp_sync_s:.4g} + p2p "
        f"{p.p2p_s:.4g} + optimizer {p.optimizer_s:.4g} + bubble {p.bubble_s:.4g}; {p.tokens_per_s:,.0f} tokens/s, "
        f"{p.tflops_per_device:.1f} TFLOPS/GPU, {p.memory_gb:.1f} GB/GPU",
    ]
    lines += [f"  note: {note}" for note in plan.notes]
    return "\n".join(lines)


def format_comparison(plans: dict[str, Plan], reference: str = "holmes") -> str:
    """One row per plan: degrees, layers per stage, predicted step, throughput, and how much faster `reference` is.

    Plans whose DP groups span clusters or NIC kinds are marked: they lie outside Holmes' layouts, so nothing keeps
    them from being predicted faster (with small gradients and large activations, sharing a DP group across
    clusters can cost less than a stage boundary between them).
    """
    base = plans[reference]
    header = (
        f"  {'plan':<14}{'pp x dp':<9}{'layers/stage':<22}{'mb':>5}{'step s':>10}{'tokens/s':>12}{'TFLOPS/GPU':>12}"
        f"{'compute':>9}{'sync':>8}{'p2p':>8}{'optim':>8}{'bubble':>8}  {reference} speedup"
    )
    lines = ["Predicted step, same cost model:", header]
    for name, plan in plans.items():
        p = plan.prediction
        layers = ",".join(map(str, plan.layers_per_stage()))
        label = name + ("*" if any(stage.mixes_fabrics for stage in plan.stages) else "")
        lines.append(
            f"  {label:<14}{f'{plan.pp}x{plan.dp}':<9}{layers[:21]:<22}{plan.microbatches:>5}{p.total_s:>10.4g}"
            f"{p.tokens_per_s:>12,.0f}{p.tflops_per_device:>12.1f}{_ms(p.compute_s):>9}{_ms(p.dp_sync_s):>8}"
            f"{_ms(p.p2p_s):>8}{_ms(p.optimizer_s):>8}{_ms(p.bubble_s):>8}  {base.speedup_over(plan):.2f}x"
        )
    if any(line.split()[0].endswith("*") for line in lines[2:]):
        lines.append("  * DP groups span clusters or NIC kinds: not a Holmes layout (each DP group on one fabric)")
    return "\n".join(lines)


def format_cross_site(
    pipeline: Plan, predictions: Sequence[DiLoCoPrediction], problems: Sequence[str], settings: DiLoCoSettings
) -> str:
    """Holmes' one pipeline across the clusters next to DiLoCo over each way of seeing them as sites."""
    fragments = f"in {settings.fragments} fragments, " if settings.fragments > 1 else ""
    streaming = (
        f"streamed {fragments}each over the next {settings.overlap_steps} inner step(s)"
        if settings.streaming
        else "after them"
    )
    lines = [
        f"Across sites: one pipeline, or DiLoCo (a replica per site planned by Holmes, pseudo-gradients of "
        f"{settings.outer_bits} bits all-reduced every {settings.sync_every} steps, {streaming}):",
        f"  {'mode':<10}{'sites':<16}{'samples/site':<14}{'pp x dp':<16}{'inner step s':>12}"
        f"{'outer sync (link)':>24}{'exposed/step':>14}{'tokens/s':>12}  vs pipeline",
    ]
    p = pipeline.prediction
    lines.append(
        f"  {'pipeline':<10}{'one job':<16}{'':<14}{f'{pipeline.pp}x{pipeline.dp}':<16}{p.total_s:>12.4g}{'':>24}"
        f"{'':>14}{p.tokens_per_s:>12,.0f}  1.00x"
    )
    for d in predictions:
        degrees = ",".join(f"{plan.pp}x{plan.dp}" for plan in d.plans)
        sync = f"{_ms(d.outer_sync_s)} ({d.link.gbps:g} Gb/s)"
        lines.append(
            f"  {'diloco':<10}{d.label:<16}{','.join(map(str, d.batches)):<14}{degrees:<16}{d.inner_step_s:>12.4g}"
            f"{sync:>24}{_ms(d.exposed_sync_s / d.sync_every):>14}{d.tokens_per_s:>12,.0f}  "
            f"{d.tokens_per_s / p.tokens_per_s:.2f}x"
        )
    lines += [f"  diloco {problem}" for problem in problems]
    return "\n".join(lines)


def fabric_label(stage: StagePlan) -> str:
    """`A/infiniband`, or `A,B/infiniband,roce` for a DP group that spans clusters and NIC kinds."""
    return f"{','.join(stage.clusters)}/{','.join(nic.value for nic in stage.nics)}"


def _layer_range(profile: ModelProfile | None, start: int, stop: int) -> str:
    if profile is None:
        return f"{start}-{stop - 1}"
    first, last = profile.layers[start].name, profile.layers[stop - 1].name
    names = first if stop - start == 1 else f"{first}..{last}"
    return f"{start}-{stop - 1} ({names})"


def _ms(seconds: float) -> str:
    if seconds < 1e-6:
        return "0"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g}us"
    return f"{seconds * 1e3:.3g}ms" if seconds < 1 else f"{seconds:.3g}s"


def _ranks(ranks: tuple[int, ...]) -> str:
    """Runs of consecutive ranks as ranges: (0, 1, 2, 5) -> "0-2, 5"."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)
