"""The pictures show what they claim: plan map and timelines, and the probe's bars (the bench chart: test_bench)."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import pytest
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from pictures import colour_pixels

from holmes_lightning.cli.config import ModelConfig
from holmes_lightning.cli.probe import ClassSummary, plot
from holmes_lightning.planner import BatchSettings, ModelProfile, PlanOptions, compare_plans
from holmes_lightning.planner.draw import BACKWARD, FORWARD, draw_plans
from holmes_lightning.topology import Topology

# Not a shipped cluster: three RoCE nodes of 2 GPUs and one InfiniBand node of 4, slow links between them.
ODD_CLUSTER = {
    "name": "odd",
    "devices_per_node": 2,
    "inter_cluster": {"gbps": 25},
    "clusters": [
        {"name": "X", "nodes": 3, "nic": {"kind": "roce", "gbps": 100}},
        {"name": "Y", "nodes": 1, "devices_per_node": 4, "nic": {"kind": "infiniband", "gbps": 200}},
    ],
}


def _rectangles(axes) -> list:
    return [patch for patch in axes.patches if patch.get_fill()]


def test_plan_picture_shows_every_stage_rank_and_micro_batch(tmp_path: Path, saved_figures: list[Figure]) -> None:
    topology = Topology.from_config(ODD_CLUSTER)
    profile = ModelProfile.from_gpt(ModelConfig(n_layers=12, d_model=1024, n_heads=16, seq_len=1024))
    plans = compare_plans(topology, profile, BatchSettings(64, 8), options=PlanOptions(schedule="Interleaved1F1B"))
    shown = ("holmes", "nic_unaware")
    png = draw_plans(plans, topology, tmp_path / "plan.png", timelines=shown)
    (figure,) = saved_figures
    cluster_map, throughput, *timelines = figure.axes

    # The map: one square per GPU, labelled with its rank; one colour per stage, holding exactly that stage's ranks.
    ranks_by_colour = defaultdict(set)
    where = {text: cluster_map.transData.transform(text.get_position()) for text in cluster_map.texts}
    for square in _rectangles(cluster_map):
        (label,) = [text for text, xy in where.items() if square.contains_point(xy)]
        ranks_by_colour[square.get_facecolor()].add(int(label.get_text()))
    holmes = plans["holmes"]
    assert sorted(map(sorted, ranks_by_colour.values())) == sorted(sorted(stage.ranks) for stage in holmes.stages)
    pixels = {colour: colour_pixels(png, colour) for colour in ranks_by_colour}  # the saved PNG shows them too
    for colour, ranks in ranks_by_colour.items():
        assert pixels[colour] / sum(pixels.values()) == pytest.approx(len(ranks) / topology.world_size, rel=0.15)

    # Throughput: one bar per compared plan, as long as its predicted TFLOPS per GPU.
    names = [label.get_text() for label in throughput.get_yticklabels()]
    assert names == list(plans)
    widths = [bar.get_width() for bar in throughput.patches]
    assert widths == pytest.approx([plans[name].prediction.tflops_per_device for name in names])

    # Timelines: per stage row, one forward and one backward block per micro-batch and model chunk.
    assert len(timelines) == len(shown)
    for name, axes in zip(shown, timelines, strict=True):
        plan = plans[name]
        blocks = Counter(
            (plan.pp - 1 - int(block.get_y()), block.get_facecolor()) for block in _rectangles(axes)
        )  # row 0 is the last stage
        for stage in plan.stages:
            expected = plan.microbatches * len(stage.chunks)
            assert blocks[stage.index, to_rgba(FORWARD)] == expected, (name, stage.index)
            assert blocks[stage.index, to_rgba(BACKWARD)] == expected, (name, stage.index)


def test_probe_plot_has_the_configured_and_measured_bars(tmp_path: Path, saved_figures: list[Figure]) -> None:
    scale = 1 / 500
    rows = [  # lab Mb/s at scale 1/500: 400 for 200 Gb/s, 200 for 100 Gb/s
        ClassSummary("rdma:A", gbps=200, lab_mbit=400, gloo_mbit=390, socket_mbit=396, worst_ratio=0.97, pairs=2),
        ClassSummary("inter_cluster", gbps=100, lab_mbit=200, gloo_mbit=180, socket_mbit=198, worst_ratio=0.9, pairs=8),
    ]
    plot(rows, scale, "two", str(tmp_path / "probe.png"))
    (figure,) = saved_figures
    (axes,) = figure.axes
    configured, gloo, raw = axes.containers
    assert [bar.get_height() for bar in configured] == pytest.approx([200, 100])
    assert [bar.get_height() for bar in gloo] == pytest.approx([195, 90])  # real Gb/s: lab Mb/s / 1000 / scale
    assert [bar.get_height() for bar in raw] == pytest.approx([198, 99])
    assert [label.get_text().split("\n")[0] for label in axes.get_xticklabels()] == ["rdma:A", "inter_cluster"]
