"""Pictures of plans: a cluster map coloured by stage, predicted throughput, and step timelines (matplotlib PNG)."""

from __future__ import annotations

from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from holmes_lightning.planner.plan_types import Plan
from holmes_lightning.planner.report import fabric_label
from holmes_lightning.planner.simulate import simulate
from holmes_lightning.topology import Topology

NIC_COLOURS = {"infiniband": "#1f4e9c", "roce": "#c0392b", "ethernet": "#7f8c8d"}
FORWARD, BACKWARD, WEIGHT, SYNC, OPTIMIZER = "#8ecae6", "#1d3557", "#6a4c93", "#e76f51", "#f4a261"


def draw_plans(plans: dict[str, Plan], topology: Topology, path: str | Path, timelines: tuple[str, ...] = ()) -> Path:
    """Cluster map of `plans["holmes"]`, TFLOPS/GPU of every plan, and the timelines of `timelines` (same x axis)."""
    shown = [name for name in timelines or ("holmes", "nic_unaware") if name in plans]
    heights = [max(2.2, 0.32 * len(topology.nodes) + 0.8)] + [max(1.6, 0.42 * plans[n].pp + 0.9) for n in shown]
    figure = Figure(figsize=(14, sum(heights) + 0.8), layout="constrained")
    rows = figure.add_gridspec(len(heights), 2, height_ratios=heights, width_ratios=[3, 2])
    holmes = plans["holmes"]
    _cluster_map(figure.add_subplot(rows[0, 0]), topology, holmes)
    _throughput(figure.add_subplot(rows[0, 1]), plans)
    horizon = max(plans[n].prediction.total_s for n in shown)  # the simulated step of each
    for row, name in enumerate(shown, start=1):
        _timeline(figure.add_subplot(rows[row, :]), name, plans[name], horizon)
    figure.suptitle(
        f"{topology.name}: {topology.world_size} GPUs, {holmes.schedule}, {holmes.microbatches} micro-batches per step",
        fontsize=13,
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def _cluster_map(axes, topology: Topology, plan: Plan) -> None:
    """One row per node, one square per GPU coloured by its stage; the node's edge colour is its NIC kind."""
    colours = colormaps["tab10" if plan.pp <= 10 else "tab20"]
    widest = max(len(node.ranks) for node in topology.nodes)
    for row, node in enumerate(reversed(topology.nodes)):
        for column, rank in enumerate(node.ranks):
            stage, _ = plan.coordinate(rank)
            axes.add_patch(Rectangle((column, row + 0.1), 0.9, 0.8, color=colours(stage % colours.N)))
            if widest <= 16:
                axes.text(column + 0.45, row + 0.5, str(rank), ha="center", va="center", fontsize=7, color="white")
        edge = Rectangle((-0.08, row + 0.03), len(node.ranks) - 0.02, 0.94, fill=False, lw=2, ec=NIC_COLOURS[node.nic])
        axes.add_patch(edge)
        label = f"{node.name}  {node.nic.value} {node.nic_gbps:g} Gb/s, {node.device_tflops:g} TFLOPS"
        axes.text(widest + 0.3, row + 0.5, label, va="center", fontsize=8)
    axes.set_xlim(-0.3, widest + 7)
    axes.set_ylim(0, len(topology.nodes))
    axes.axis("off")
    stages = [Patch(color=colours(s.index % colours.N), label=f"stage {s.index}") for s in plan.stages[:20]]
    nics = [
        Patch(fill=False, ec=c, lw=2, label=k)
        for k, c in NIC_COLOURS.items()
        if any(n.nic.value == k for n in topology.nodes)
    ]
    handles = stages + nics
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, 0), fontsize=7, ncols=min(len(handles), 8))
    axes.set_title(
        f"Holmes layout: GPU squares coloured by stage, node outline by NIC (inter-cluster TCP "
        f"{_inter_cluster(topology)})",
        fontsize=9,
    )


def _inter_cluster(topology: Topology) -> str:
    """`100 Gb/s`, or `10 Gb/s; A<->B 100, B<->C 25` where pairs of clusters have their own speed."""
    inter = topology.spec.inter_cluster
    pairs = "".join(f", {'<->'.join(sorted(pair.clusters))} {pair.gbps:g}" for pair in inter.pairs)
    return f"{inter.gbps:g} Gb/s" + (f"; pairs{pairs}" if pairs else "")


def _throughput(axes, plans: dict[str, Plan]) -> None:
    names = list(plans)
    values = [plans[n].prediction.tflops_per_device for n in names]
    bars = axes.barh(names, values, color=["#2a9d8f" if n == "holmes" else "#adb5bd" for n in names])
    axes.bar_label(bars, labels=[f"{v:.1f}" for v in values], fontsize=8, padding=2)
    axes.invert_yaxis()
    axes.set_xlabel("predicted TFLOPS per GPU (model FLOPs)")
    axes.set_xlim(0, max(values) * 1.2)
    axes.set_title("Same cost model, alternatives side by side", fontsize=9)


def _timeline(axes, name: str, plan: Plan, horizon: float) -> None:
    """One row per stage (stage 0 on top): forward and backward (and weight-pass) blocks per micro-batch, then the
    exposed sync."""
    timeline = simulate(
        plan.stages, plan.schedule, plan.microbatches, shared_cores=plan.shared_cores, backend=plan.backend
    )
    for block in timeline.blocks:
        colour = {"forward": FORWARD, "backward": BACKWARD, "weight": WEIGHT, "sync": SYNC, "optimizer": OPTIMIZER}[
            block.kind
        ]
        y = plan.pp - 1 - block.stage
        axes.add_patch(Rectangle((block.start, y + 0.12), block.end - block.start, 0.76, fc=colour, ec="white", lw=0.4))
        if block.kind in ("forward", "backward", "weight") and (block.end - block.start) > horizon / 90:
            text_colour = "black" if block.kind == "forward" else "white"
            axes.text(
                (block.start + block.end) / 2,
                y + 0.5,
                str(block.microbatch),
                ha="center",
                va="center",
                fontsize=6,
                color=text_colour,
            )
    labels = [f"stage {s.index}  {fabric_label(s)}" for s in reversed(plan.stages)]
    axes.set_yticks([i + 0.5 for i in range(plan.pp)], labels, fontsize=8)
    axes.set_ylim(0, plan.pp)
    axes.set_xlim(0, horizon * 1.01)
    axes.set_xlabel("seconds into the step")
    p = plan.prediction
    axes.set_title(
        f"{name}: step {p.total_s:.4g} s (compute {p.compute_s:.3g}, DP sync {p.dp_sync_s:.3g}, p2p {p.p2p_s:.3g}, "
        f"optimizer {p.optimizer_s:.3g}, bubble {p.bubble_s:.3g}), layers/stage {plan.layers_per_stage()}",
        fontsize=9,
        loc="left",
    )
    handles = [
        Patch(color=FORWARD, label="forward"),
        Patch(color=BACKWARD, label="backward"),
        *([Patch(color=WEIGHT, label="weight grad")] if plan.schedule.splits_backward else []),
        Patch(color=SYNC, label="DP sync"),
        Patch(color=OPTIMIZER, label="optimizer"),
    ]
    axes.legend(handles=handles, loc="lower right", bbox_to_anchor=(1, 1), fontsize=7, ncols=5, frameon=False)
