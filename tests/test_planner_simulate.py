"""The step simulator and the schedules' orders against hand-computed cases."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from holmes_lightning.planner import MachineCosts, StagePlan, simulate
from holmes_lightning.planner.cost import GLOO_EARLY_BYTES, CostModel
from holmes_lightning.planner.options import Schedule
from holmes_lightning.planner.plan_types import locate_virtual, virtual_stage
from holmes_lightning.planner.plan_types import virtual_stages as virtual_stages_of
from holmes_lightning.planner.schedules import held_at_peaks, microbatch_problem, peak_stash, stage_actions
from holmes_lightning.planner.simulate import Timeline
from holmes_lightning.topology import NICKind, Topology


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


def virtual_stages(pp, *, forward, backward, sends, tails, weight=None, v_shaped=False):
    """`pp` stages with per virtual stage seconds (virtual stage `virtual_stage(s, j, pp)` on stage s; `weight`: of
    each backward, the weight pass of a zero-bubble schedule) and per-stage exposed syncs."""
    chunks = len(forward) // pp
    own = [[virtual_stage(s, j, pp, v_shaped=v_shaped) for j in range(chunks)] for s in range(pp)]
    return [
        StagePlan(
            index=s,
            ranks=(s,),
            chunks=tuple((0, 1) for _ in range(chunks)),
            clusters=("A",),
            nics=(NICKind.infiniband,),
            forward_s=tuple(forward[v] for v in own[s]),
            backward_s=tuple(backward[v] for v in own[s]),
            weight_s=tuple(weight[v] for v in own[s]) if weight else (),
            send_s=tuple(sends[v] for v in own[s]),
            exposed_sync_s=tails[s],
        )
        for s in range(pp)
    ]


def passes(timeline: Timeline) -> list[list[tuple[str, int, float, float]]]:
    """Per stage: its forwards and backwards as (kind, micro-batch, start, end)."""
    return [
        [(b.kind, b.microbatch, b.start, b.end) for b in timeline.stage_blocks(s) if b.kind in ("forward", "backward")]
        for s in range(len(timeline.stage_end_s))
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
    first = passes(timeline)[0]
    assert first == [("forward", 0, 0, 1), ("forward", 1, 1, 2), ("backward", 0, 7, 9), ("backward", 1, 13, 15)]


def test_transfers_and_sync_by_hand():
    # one micro-batch, GPipe: F0 (1) + send (0.5) + F1 (1) + B1 (2) + send back (0.5) + B0 (2), then stage 0's sync (3);
    # stage 1 waits for its gradient to be through (5) before its own sync (1)
    timeline = simulate(stages([1.0, 1.0], [2.0, 2.0], sends=[0.5, 0.0], syncs=[3.0, 1.0]), "GPipe", 1)
    assert timeline.stage_end_s == pytest.approx((7.0 + 3.0, 5.0 + 1.0))
    assert timeline.total_s == pytest.approx(10.0)


def test_transfers_start_when_the_receiver_posts_its_recv():
    # GPipe, 2 micro-batches, transfers (3) slower than compute (1). Stage 1 posts its recv for F1 only after F0 ends
    # at 5, so the second activation, sent at 2, moves [5,8]: F0 [4,5] F1 [8,9] B0 [9,10] B1 [10,11]. Stage 0 waits for
    # its forward sends (through at 8) before posting the recv for B0, whose gradient moves [10,13]: B0 [13,14]; B1's
    # recv is posted at 14, its gradient moves [14,17]: B1 [17,18]. Stage 1 ends when that send is through (17).
    timeline = simulate(stages([1.0, 1.0], [1.0, 1.0], sends=[3.0, 0.0]), "GPipe", 2)
    blocks = passes(timeline)
    assert blocks[0] == [("forward", 0, 0, 1), ("forward", 1, 1, 2), ("backward", 0, 13, 14), ("backward", 1, 17, 18)]
    assert blocks[1] == [("forward", 0, 4, 5), ("forward", 1, 8, 9), ("backward", 0, 9, 10), ("backward", 1, 10, 11)]
    assert timeline.stage_end_s == pytest.approx((18.0, 17.0))


def test_buffered_sends_are_done_once_the_recv_is_posted():
    # The GPipe case above on gloo, whose send is done when both sides have posted (its data left to the sockets).
    # Transfers and passes are timed as before; stage 1's last send (B1's gradient, posted at 11, recv posted at 14)
    # is done at 14, not when it arrives (17), so stage 1 ends at 14.
    unbuffered = simulate(stages([1.0, 1.0], [1.0, 1.0], sends=[3.0, 0.0]), "GPipe", 2)
    timeline = simulate(stages([1.0, 1.0], [1.0, 1.0], sends=[3.0, 0.0]), "GPipe", 2, backend="gloo")
    assert passes(timeline) == passes(unbuffered)
    assert timeline.stage_end_s == pytest.approx((18.0, 14.0))


def test_early_bytes_cross_before_the_recv_is_posted():
    # The GPipe case above with the first third of each transfer (1 of 3) crossing before the recv (gloo). F1's
    # activation, sent at 2, starts when the link is free (4): its early part [4,5], the rest after the recv posted at
    # 5: through at 7, F1 [7,8]. Stage 1: B0 [8,9], B1 [9,10]. Stage 0 posts B0's recv at 7 (its forward sends are
    # through): the gradient, sent at 9, moves [9,12]; B1's gradient, sent at 10, waits for the link (12), its recv is
    # posted at 13: through at max(12 + 3, 13 + 3 - 1) = 15. Stage 0: B0 [12,13], B1 [15,16].
    with_early = [replace(stage, early_s=(1.0,)) for stage in stages([1.0, 1.0], [1.0, 1.0], sends=[3.0, 0.0])]
    blocks = passes(simulate(with_early, "GPipe", 2))
    assert blocks[0] == [("forward", 0, 0, 1), ("forward", 1, 1, 2), ("backward", 0, 12, 13), ("backward", 1, 15, 16)]
    assert blocks[1] == [("forward", 0, 4, 5), ("forward", 1, 7, 8), ("backward", 0, 8, 9), ("backward", 1, 9, 10)]


def test_gloo_moves_a_message_start_before_its_recv_nccl_none():
    link = Topology.from_config("two_cluster_mixed").link(0, 2)
    gloo, nccl = (CostModel(topology=None, profile=None, backend=backend) for backend in ("gloo", "nccl"))
    assert gloo.early_s(GLOO_EARLY_BYTES * 4, link) == pytest.approx(GLOO_EARLY_BYTES / link.bytes_per_s)
    assert gloo.early_s(1000.0, link) == pytest.approx(1000.0 / link.bytes_per_s)  # a small message: all of it
    assert nccl.early_s(1000.0, link) == 0.0


def test_1f1b_waits_for_each_send_with_the_next_recv():
    # 1F1B, 2 stages, 2 micro-batches, transfers 1. Stage 0: F0 [0,1], F1 [1,2] (warm-up; F0's send is waited after
    # F1, through at 2: stage 1 posted its recv at 0). Stage 1: F0 [2,3], B0 [3,4]; with B0's send it posts the recv
    # for F1 (sent at 2, moves [4,5]): F1 [5,6] once B0's gradient is through too. Stage 0 posted B0's recv with F1's
    # send at 2: the gradient moves [4,5], B0 [5,6]; B1's recv is posted at 6 (the gradient, sent at 7, moves
    # [7,8]): B1 [8,9]. Stage 1: B1 [6,7] (it posts no recv for it), then waits for its send: through at 8.
    timeline = simulate(stages([1.0, 1.0], [1.0, 1.0], sends=[1.0, 0.0]), "1F1B", 2)
    blocks = passes(timeline)
    assert blocks[0] == [("forward", 0, 0, 1), ("forward", 1, 1, 2), ("backward", 0, 5, 6), ("backward", 1, 8, 9)]
    assert blocks[1] == [("forward", 0, 2, 3), ("backward", 0, 3, 4), ("forward", 1, 5, 6), ("backward", 1, 6, 7)]
    assert timeline.stage_end_s == pytest.approx((9.0, 8.0))


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
    assert peak_stash(held_at_peaks(stage_actions("GPipe", 0, 4, 8), 1), [1.0]) == 8
    in_flight = [peak_stash(held_at_peaks(stage_actions("1F1B", s, 4, 8), 1), [1.0]) for s in range(4)]
    assert in_flight == [4, 3, 2, 1]


@settings(max_examples=150, deadline=None)
@given(
    pp=st.integers(1, 6),
    rounds=st.integers(1, 4),
    chunks=st.integers(1, 4),
    stash=st.lists(st.floats(0, 1e9), min_size=4, max_size=4),
)
def test_the_peak_stash_is_at_one_of_the_moments_kept(pp, rounds, chunks, stash):
    """The running sum of forwards held, action by action, peaks at the largest weighted count `held_at_peaks` kept."""
    for stage in range(pp):
        actions = stage_actions("Interleaved1F1B", stage, pp, pp * rounds, chunks)
        held = running = 0.0
        for action in actions:
            held += -stash[action.chunk] if action.backward else stash[action.chunk]
            running = max(running, held)
        assert peak_stash(held_at_peaks(actions, chunks), stash[:chunks]) == pytest.approx(running, rel=1e-12)


def test_microbatch_minimums():
    assert "1F1B needs microbatches >= stages" in microbatch_problem("1F1B", 4, 3)
    assert microbatch_problem("1F1B", 4, 4) is None
    assert microbatch_problem("GPipe", 4, 1) is None
    assert "multiple of" in microbatch_problem("Interleaved1F1B", 4, 9)  # 2 rounds of 4.5
    assert microbatch_problem("Interleaved1F1B", 4, 10) is None  # torch: 2 rounds of 5
    assert microbatch_problem("Interleaved1F1B", 4, 12) is None


def test_exposed_sync_overlap_is_capped_by_the_pass_and_absent_in_a_pipeline():
    cost = CostModel(topology=None, profile=None, machine=MachineCosts(dp_overlap=0.75))
    assert cost.exposed_sync_s(4.0, compute_s=10.0) == pytest.approx(1.0)  # 75% hidden
    assert cost.exposed_sync_s(4.0, compute_s=2.0) == pytest.approx(2.0)  # at most the pass's 2 s hidden
    assert cost.exposed_sync_s(4.0, compute_s=10.0, pipelined=True) == 4.0  # reduced after the schedule


@pytest.mark.parametrize(
    ("schedule", "chunks", "step"),
    [
        ("1F1B", 1, 33.0),
        ("InterleavedZeroBubble", 1, 27.0),
        ("Interleaved1F1B", 2, 28.5),
        ("InterleavedZeroBubble", 2, 25.5),
        ("ZBVZeroBubble", 2, 25.5),  # the first micro-batch's way down the V's first half, then no bubble
        ("DualPipeV", 2, 25.5),
    ],
)
def test_weight_passes_fill_the_bubble_as_the_zero_bubble_paper_counts(schedule, chunks, step):
    """4 equal stages, 8 micro-batches, free links, forward 1, backward 2 (input pass 1, weight pass 1): 1F1B's step
    is (m + p - 1)(F + B); ZB1P's m(F + B) + (p - 1)(F + I - W) (Qi et al., ZB-H1); interleaving divides the bubble by
    the chunks."""
    pp, m, virtual = 4, 8, 4 * chunks
    stages = virtual_stages(
        pp,
        forward=[1.0 / chunks] * virtual,
        backward=[2.0 / chunks] * virtual,
        sends=[0.0] * virtual,
        tails=[0.0] * pp,
        weight=[1.0 / chunks] * virtual,
        v_shaped=Schedule(schedule).v_shaped,
    )
    assert simulate(stages, schedule, m).total_s == pytest.approx(step)


@pytest.mark.parametrize("v_shaped", [False, True])
@pytest.mark.parametrize("pp", [1, 2, 3, 5])
def test_a_stages_virtual_stages_are_where_locate_virtual_finds_them(pp, v_shaped):
    """Loop placement: stage s runs s, s + pp; V: s and 2 pp - 1 - s. Every virtual stage is run exactly once."""
    placed = {k: (s, j) for s in range(pp) for j, k in enumerate(virtual_stages_of(s, 2, pp, v_shaped=v_shaped))}
    assert sorted(placed) == list(range(2 * pp))
    assert all(locate_virtual(k, pp, v_shaped=v_shaped) == where for k, where in placed.items())
    if v_shaped:  # the turn: the last stage runs both the first half's end and the second half's start
        assert placed[pp - 1] == (pp - 1, 0) and placed[pp] == (pp - 1, 1)
