"""The regret benchmark's pure parts: rank statistics, the verdict per cluster, and the configurations it runs."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from holmes_lightning.bench.calibrate import lab_topology
from holmes_lightning.bench.model import BenchModel
from holmes_lightning.bench.regret import ClusterRegret, Row, configurations, ranks, spearman
from holmes_lightning.bench.variants import on_gloo
from holmes_lightning.cli.config import ModelConfig
from holmes_lightning.planner import MachineCosts, PlanOptions
from holmes_lightning.planner.choice import STEP_TOLERANCE
from holmes_lightning.planner.options import MODELLED_SCHEDULES
from holmes_lightning.topology import Topology


def test_ranks_share_the_average_of_tied_places():
    assert ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
    assert ranks([5.0, 5.0, 5.0]) == [2.0, 2.0, 2.0]


@pytest.mark.parametrize(
    ("xs", "ys", "expected"),
    [
        ([1, 2, 3, 4, 5], [10, 20, 30, 40, 50], 1.0),
        ([1, 2, 3, 4, 5], [5, 4, 3, 2, 1], -1.0),
        ([1, 2, 3, 4, 5], [2, 1, 4, 3, 5], 0.8),  # two swapped pairs: 1 - 6 * 4 / (5 * 24)
        ([1, 2, 2, 3], [1, 2, 3, 4], 4.5 / math.sqrt(4.5 * 5)),  # a tie: ranks 1, 2.5, 2.5, 4 against 1..4
    ],
)
def test_spearman_by_hand(xs, ys, expected):
    assert spearman(xs, ys) == pytest.approx(expected)


distinct = st.lists(st.integers(-1000, 1000), min_size=3, max_size=12, unique=True)


@given(distinct, st.randoms(use_true_random=False))
def test_spearman_depends_only_on_order(xs, random):
    ys = [x**3 + 7 for x in xs]  # the same order, other values (exact: integers)
    assert spearman(xs, ys) == pytest.approx(1.0)
    shuffled = random.sample(xs, len(xs))
    assert spearman(xs, shuffled) == pytest.approx(spearman(shuffled, xs))
    assert spearman(xs, shuffled) == pytest.approx(-spearman(xs, [-y for y in shuffled]))
    assert -1.0 - 1e-9 <= spearman(xs, shuffled) <= 1.0 + 1e-9


def row(name: str, predicted: float, measured: float, chosen: bool = False) -> Row:
    return Row("c", name, layout=name, chosen=chosen, predicted_s=predicted, measured_s=measured, step_s=(measured,))


def test_the_choice_is_ranked_by_measured_step_against_the_fastest():
    rows = (
        row("a", 1.0, 2.06, chosen=True),
        row("b", 1.1, 2.0),
        row("c", 1.5, 3.0),
        row("d", 2.0, 4.0),
    )
    result = ClusterRegret("c", rows, calibration=None, foreign_load=0.0)
    assert (result.choice.name, result.best.name, result.choice_rank) == ("a", "b", 2)
    assert result.regret == pytest.approx(0.03)
    assert result.spearman == pytest.approx(0.8)  # one adjacent swap among four: 1 - 6 * 2 / (4 * 15)
    assert not result.met  # within 5% of the best, but predicted and measured orders agree too little
    agreeing = ClusterRegret("c", (*rows[:1], row("b", 1.1, 2.1), *rows[2:]), calibration=None, foreign_load=0.0)
    assert (agreeing.choice_rank, agreeing.regret, agreeing.spearman, agreeing.met) == (1, 0.0, 1.0, True)
    slow_choice = ClusterRegret("c", (row("a", 1.0, 2.2, chosen=True), *rows[1:]), calibration=None, foreign_load=0.0)
    assert slow_choice.regret == pytest.approx(0.1) and not slow_choice.met


@pytest.mark.parametrize("schedules", [None, MODELLED_SCHEDULES], ids=["job's schedule", "every schedule"])
@pytest.mark.parametrize("cluster", ["two_cluster_mixed", "three_cluster"])
def test_every_configuration_is_distinct_and_none_is_predicted_much_faster_than_the_choice(cluster, schedules):
    model = ModelConfig(n_layers=6, d_model=64, n_heads=4, seq_len=32)
    profile = BenchModel(gpt=model).profile()
    topology = Topology.from_config(cluster)
    share = 2 / topology.world_size
    costs = MachineCosts(
        efficiency=1.0,  # the lab topology's devices run at the measured speed
        layer_overhead_s=1e-3,
        optimizer_s_per_gb=1.0,
        fsdp_layer_s=3e-4,
        fsdp_reshard_layer_s=3e-3,
        fsdp_optimizer_layer_s=5e-4,
        latency_s=3e-4,
    )
    lab = lab_topology(topology, 1e-3, 50 * share / 1e3)
    options = on_gloo(PlanOptions())
    plans, chosen = configurations(lab, profile, global_batch=16, options=options, costs=costs, schedules=schedules)
    assert chosen in plans and len(plans) >= 6
    assert {p.schedule for p in plans.values()} == set(schedules or [options.schedule])  # each runs here
    runs = {
        (tuple((s.ranks, s.chunks) for s in p.stages), p.microbatches, p.sharding, p.schedule) for p in plans.values()
    }
    assert len(runs) == len(plans)  # a plan found twice runs once
    assert {p.global_batch for p in plans.values()} == {16}
    assert {p.sharding for p in plans.values()} == {"none", "fsdp"}
    assert {p.pp * p.dp for p in plans.values()} == {topology.world_size}
    best = min(p.prediction.total_s for p in plans.values())
    assert plans[chosen].prediction.total_s < best * (1 + STEP_TOLERANCE)  # within it, the least memory is chosen
