"""The step simulator and the schedules' orders against hand-computed cases."""

import pytest

from holmes_lightning.planner import StagePlan, simulate
from holmes_lightning.planner.cost import CostModel
from holmes_lightning.planner.schedules import microbatch_problem, peak_stash, stage_actions
from holmes_lightning.topology import NICKind


def stages(forward, backward, sends=None, syncs=None, chunks=1):
    """Stages with per-chunk times; `forward[s]` is one number (every chunk the same) per stage."""
    pp = len(forward)
    per_virtual = [s % pp for s in range(pp * chunks)]
    return virtual_stages(
        pp,
        forward=[forward[s] for s in per_virtual],
        backward=[backward[s] for s in per_virtual],
        sends=[(sends or [0.0] * pp)[s] for s in per_virtual],
        tails=syncs or [0.0] * pp,
    )


def virtual_stages(pp, *, forward, backward, sends, tails):
    """`pp` stages with per virtual stage seconds (virtual stage v on stage v % pp) and per-stage exposed syncs."""
    chunks = len(forward) // pp
    return [
        StagePlan(
            index=s,
            ranks=(s,),
            chunks=tuple((0, 1) for _ in range(chunks)),
            clusters=("A",),
            nics=(NICKind.infiniband,),
            forward_s=tuple(forward[s + j * pp] for j in range(chunks)),
            backward_s=tuple(backward[s + j * pp] for j in range(chunks)),
            send_s=tuple(sends[s + j * pp] for j in range(chunks)),
            exposed_sync_s=tails[s],
        )
        for s in range(pp)
    ]


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize(("pp", "m"), [(1, 1), (2, 4), (4, 4), (4, 8), (3, 7)])
def test_equal_stages_take_m_plus_p_minus_1_stage_times(schedule, pp, m):
    f, b = 1.0, 2.0
    timeline = simulate(stages([f] * pp, [b] * pp), schedule, m)
    assert timeline.total_s == pytest.approx((m + pp - 1) * (f + b))


@pytest.mark.parametrize(("pp", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 8, 4), (2, 6, 3)])
def test_interleaving_divides_the_bubble_by_the_chunks(pp, m, v):
    f, b = 1.0, 2.0  # per chunk: a device's whole micro-batch costs v * (f + b)
    timeline = simulate(stages([f] * pp, [b] * pp, chunks=v), "Interleaved1F1B", m)
    per_device = v * (f + b)
    assert timeline.total_s == pytest.approx(m * per_device + (pp - 1) * per_device / v)


def test_unequal_1f1b_by_hand():
    # stage 0: F0 [0,1] F1 [1,2] B0 [7,9] B1 [13,15]; stage 1: F0 [1,3] B0 [3,7] F1 [7,9] B1 [9,13]
    timeline = simulate(stages([1.0, 2.0], [2.0, 4.0]), "1F1B", 2)
    assert timeline.total_s == pytest.approx(15.0)
    first = [(b.kind, b.microbatch, b.start, b.end) for b in timeline.stage_blocks(0) if b.kind != "sync"]
    assert first == [("forward", 0, 0, 1), ("forward", 1, 1, 2), ("backward", 0, 7, 9), ("backward", 1, 13, 15)]


def test_transfers_and_sync_by_hand():
    # one micro-batch, GPipe: F0 (1) + send (0.5) + F1 (1) + B1 (2) + send back (0.5) + B0 (2), then stage 0's sync (3)
    timeline = simulate(stages([1.0, 1.0], [2.0, 2.0], sends=[0.5, 0.0], syncs=[3.0, 1.0]), "GPipe", 1)
    assert timeline.stage_end_s == pytest.approx((7.0 + 3.0, 4.5 + 1.0))
    assert timeline.total_s == pytest.approx(10.0)


def test_transfers_on_one_link_queue_behind_each_other():
    # GPipe, 2 micro-batches, transfers (3) slower than compute (1): the second activation leaves stage 0 at 2 but
    # waits until the first is through at 4. Stage 1: F0 [4,5] F1 [7,8] B0 [8,9] B1 [9,10]; the gradients back over
    # the other link: B0's arrives at 12, B1's waits for it and arrives at 15; stage 0: B0 [12,13] B1 [15,16].
    timeline = simulate(stages([1.0, 1.0], [1.0, 1.0], sends=[3.0, 0.0]), "GPipe", 2)
    second = [(b.kind, b.microbatch, b.start, b.end) for b in timeline.stage_blocks(1) if b.kind != "sync"]
    assert second == [("forward", 0, 4, 5), ("forward", 1, 7, 8), ("backward", 0, 8, 9), ("backward", 1, 9, 10)]
    assert timeline.total_s == pytest.approx(16.0)


def test_orders_follow_torch():
    # torch's Schedule1F1B: pp - stage warm-up forwards, then backward/forward pairs
    order = [("B" if a.backward else "F") + str(a.microbatch) for a in stage_actions("1F1B", 1, 3, 4)]
    assert order == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    for schedule, pp, m, v in [("GPipe", 3, 5, 1), ("1F1B", 4, 6, 1), ("Interleaved1F1B", 4, 8, 2)]:
        for stage in range(pp):
            actions = stage_actions(schedule, stage, pp, m, v)
            assert sorted((a.backward, a.chunk, a.microbatch) for a in actions) == sorted(
                (bwd, c, mb) for bwd in (False, True) for c in range(v) for mb in range(m)
            )


def test_memory_in_flight():
    assert peak_stash(stage_actions("GPipe", 0, 4, 8), [1.0]) == 8
    assert [peak_stash(stage_actions("1F1B", s, 4, 8), [1.0]) for s in range(4)] == [4, 3, 2, 1]


def test_microbatch_minimums():
    assert "1F1B needs microbatches >= stages" in microbatch_problem("1F1B", 4, 3)
    assert microbatch_problem("1F1B", 4, 4) is None
    assert microbatch_problem("GPipe", 4, 1) is None
    assert "multiple of" in microbatch_problem("Interleaved1F1B", 4, 9)  # 2 rounds of 4.5
    assert microbatch_problem("Interleaved1F1B", 4, 10) is None  # torch: 2 rounds of 5
    assert microbatch_problem("Interleaved1F1B", 4, 12) is None


def test_exposed_sync_overlap_is_capped_by_the_pass_and_absent_in_a_pipeline():
    cost = CostModel(topology=None, profile=None, dp_overlap=0.75)
    assert cost.exposed_sync_s(4.0, compute_s=10.0) == pytest.approx(1.0)  # 75% hidden
    assert cost.exposed_sync_s(4.0, compute_s=2.0) == pytest.approx(2.0)  # at most the pass's 2 s hidden
    assert cost.exposed_sync_s(4.0, compute_s=10.0, pipelined=True) == 4.0  # reduced after the schedule
