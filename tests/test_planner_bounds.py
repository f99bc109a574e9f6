"""The search's lower bounds: never above the simulated step, and the fast forms equal to the plain walks."""

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_planner_simulate import virtual_stages

from holmes_lightning.planner import simulate
from holmes_lightning.planner.bounds import (
    OneChunkWalk,
    PathShapes,
    latest_turns,
    one_chunk_path_s,
    stage_path_s,
    water_level_s,
)
from holmes_lightning.planner.options import MODELLED_SCHEDULES
from holmes_lightning.planner.plan_types import locate_virtual, virtual_stage
from holmes_lightning.planner.schedules import WEIGHT, microbatch_problem
from holmes_lightning.planner.simulate import Replay

seconds = st.floats(0.0, 5.0, allow_nan=False)


@st.composite
def pipelines(draw):
    """A schedule with random per-virtual-stage forward/backward/send seconds (and of each backward, its weight pass
    where the schedule splits it), and per-stage tails."""
    schedule = draw(st.sampled_from(MODELLED_SCHEDULES))
    pp, m = draw(st.integers(1, 6)), draw(st.integers(1, 12))
    chunks = draw(st.integers(1 if schedule.splits_backward else 2, 3)) if schedule.interleaved else 1
    chunks = 2 if schedule.v_shaped else chunks
    if microbatch_problem(schedule, pp, m):
        m = {"1F1B": max(m, pp), "DualPipeV": max(m, 2 * pp)}.get(schedule.value, pp)
    return schedule, pp, m, chunks, *draw(timings(schedule, pp, chunks))


@st.composite
def timings(draw, schedule, pp, chunks):
    """Forward, backward and send seconds per virtual stage, tails per stage, weight passes where split."""
    virtual = pp * chunks
    forward = [draw(st.floats(0.01, 3.0)) for _ in range(virtual)]
    backward = [f * draw(st.floats(0.5, 3.0)) for f in forward]
    send = [draw(st.sampled_from([0.0, 0.05, 0.5, 2.0])) for _ in range(virtual - 1)] + [0.0]
    tails = [draw(st.sampled_from([0.0, 0.3, 3.0])) for _ in range(pp)]
    weight = [b * draw(st.floats(0.0, 0.9)) for b in backward] if schedule.splits_backward else None
    return forward, backward, send, tails, weight


@settings(max_examples=150, deadline=None)
@given(pipelines(), st.sampled_from(["nccl", "gloo"]))
def test_every_path_bound_stays_under_the_simulated_step(pipeline, backend):
    """Each stage's path (with hops and excursions) and each virtual stage's (with cycles down and, on NCCL, the
    waits on its own sends), with their heads and drains, against the replay of the same step (gloo: sends done for
    their senders at the rendezvous)."""
    schedule, pp, m, chunks, forward, full, send, tails, weight = pipeline
    v_shaped = schedule.v_shaped
    stages = virtual_stages(
        pp, forward=forward, backward=full, sends=send, tails=tails, weight=weight, v_shaped=v_shaped
    )
    step = simulate(stages, schedule, m, backend=backend).total_s
    virtual = pp * chunks
    shapes = PathShapes.of(schedule, pp, m, chunks, gated=backend == "nccl")
    # a zero-bubble schedule's bounds: input passes as the backwards; the stage walk takes the weight passes too
    backward = [b - w for b, w in zip(full, weight, strict=True)] if weight else full
    weight = weight or [0.0] * virtual
    head = list(itertools.accumulate((f + c for f, c in zip(forward, send, strict=True)), initial=0.0))
    trip = list(
        itertools.accumulate((f + b + 2 * c for f, b, c in zip(forward, backward, send, strict=True)), initial=0.0)
    )
    down = list(itertools.accumulate((b + c for b, c in zip(backward, send, strict=True)), initial=0.0))
    drains = []
    for v in range(virtual):
        stage, chunk = locate_virtual(v, pp, v_shaped=v_shaped)
        ends = down[v] - down[stage] + tails[stage] if chunk == chunks - 1 else 0.0
        drains.append(ends if v == 0 else max(ends, drains[v - 1] + send[v - 1] + backward[v - 1]))
    for v in range(virtual):
        climb = None if v == virtual - 1 else 2 * send[v] + trip[virtual] - trip[v + 1]
        cycles = [(shapes.descents[u], trip[v] - trip[u]) for u in range(v)]
        walk, below = shapes.walks[v], send[v - 1] if v else 0.0
        path = one_chunk_path_s(walk, forward[v], backward[v], climb, cycles, weight[v], send[v], below)
        assert head[v] + path + drains[v] <= step * (1 + 1e-9)
        alone = walk.path_s(forward[v], backward[v], climb, weight[v], send[v], below)
        assert head[v] + alone + drains[v] <= step * (1 + 1e-9)
        if chunks == 1:
            work = m * (forward[v] + backward[v] + weight[v])
            waits = walk.waits_s(forward[v], backward[v], send[v], below)
            assert head[v] + work + waits + tails[v] <= step * (1 + 1e-9)
    for s in range(pp):
        own = [virtual_stage(s, j, pp, v_shaped=v_shaped) for j in range(chunks)]
        top, pairs = own[-1], list(itertools.pairwise(own))  # each chunk and the next, through the stages between
        hops = [sum(send[w] for w in range(u, t)) for u, t in pairs]
        path = stage_path_s(
            order=shapes.orders[s],
            forward=[forward[u] for u in own],
            backward=[backward[u] for u in own],
            excursion=None if top == virtual - 1 else 2 * send[top] + trip[virtual] - trip[top + 1],
            turns=shapes.turns,
            up=[h + sum(forward[w] for w in range(u + 1, t)) for h, (u, t) in zip(hops, pairs, strict=True)],
            down=[h + sum(backward[w] for w in range(u + 1, t)) for h, (u, t) in zip(hops, pairs, strict=True)],
            weight=[weight[u] for u in own],
        )
        trailing = sum(weight[own[j]] for j in shapes.trailing[s])
        assert head[s] + path + max(tails[s] + trailing, drains[s]) <= step * (1 + 1e-9)


@settings(max_examples=150, deadline=None)
@given(pipelines(), st.booleans(), st.data())
def test_a_critical_path_is_the_step_and_under_it_at_any_other_seconds(pipeline, buffered, data):
    """A simulated step's critical path, as long as the step; under another step's seconds (the same schedule, stages
    and micro-batches), no longer than that step: which action waits for which does not depend on the seconds."""
    schedule, pp, m, chunks, *_ = pipeline
    replay = Replay.of(schedule, pp, m, chunks)

    def seconds(forward, full, send, tails, weight):
        """The seconds as the replay takes them, and as the path counts them (input passes, early parts)."""
        weight = weight or [0.0] * len(forward)
        early = [c * data.draw(st.sampled_from([0.0, 0.5, 1.0])) for c in send]
        gradient = [b - w for b, w in zip(full, weight, strict=True)]
        as_replayed = (forward, full, send, tails, None, early, buffered, weight if schedule.splits_backward else None)
        return as_replayed, (forward, gradient, weight, send, early, tails)

    replayed, counted = seconds(*pipeline[4:])
    path = replay.critical_path(*replayed[:4], *replayed[5:])
    step = replay.step_s(*replayed)
    assert path.length_s(*counted) == pytest.approx(step, rel=1e-9, abs=1e-12)
    for _ in range(3):
        replayed, counted = seconds(*data.draw(timings(schedule, pp, chunks)))
        assert path.length_s(*counted) <= replay.step_s(*replayed) * (1 + 1e-9) + 1e-12


@settings(max_examples=200, deadline=None)
@given(
    schedule=st.sampled_from(MODELLED_SCHEDULES),
    pp=st.integers(1, 8),
    m=st.integers(1, 24),
    forward=st.floats(0.01, 2.0),
    backward=st.floats(0.01, 4.0),
    climb=st.one_of(st.none(), seconds, st.floats(0.0, 60.0)),
    data=st.data(),
)
def test_the_closed_forms_of_a_one_chunk_path_equal_the_walk(schedule, pp, m, forward, backward, climb, data):
    """1F1B's and GPipe's closed forms against the best set of excursions found by walking every backward, and both
    against the action-by-action longest path."""
    if microbatch_problem(schedule, pp, m) or schedule.v_shaped:  # (V schedules run two chunks)
        return
    orders = [[a for a in order if a.part != WEIGHT] for order in PathShapes.of(schedule, pp, m, 1).orders]
    stage = data.draw(st.integers(0, pp - 1))
    walk = OneChunkWalk.of(orders[stage], latest_turns(orders[-1], 0, m))
    if not schedule.interleaved:
        assert walk.form in ("1F1B", "first")
    plain = OneChunkWalk(walk.steps, walk.turns, walk.skipped_forwards, walk.skipped_backwards, walk.previous)
    expected = stage_path_s(
        order=orders[stage],
        forward=[forward],
        backward=[backward],
        excursion=climb,
        turns=latest_turns(orders[-1], 0, m),
        up=[],
        down=[],
    )
    assert walk.path_s(forward, backward, climb) == pytest.approx(expected, rel=1e-12)
    assert plain.path_s(forward, backward, climb) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_the_water_level_is_the_least_max_over_free_shares(seed):
    rng = random.Random(seed)
    count = rng.randint(1, 5)
    bases = [rng.uniform(0, 3) for _ in range(count)]
    rates = [rng.uniform(0.2, 3) for _ in range(count)]
    work = rng.uniform(0, 4)
    level = water_level_s(bases, rates, work)
    shares = [max(0.0, (level - b) / r) for b, r in zip(bases, rates, strict=True)]
    assert sum(shares) == pytest.approx(work) or level == pytest.approx(max(bases))
    assert max(b + r * x for b, r, x in zip(bases, rates, shares, strict=True)) == pytest.approx(level)
    for _ in range(50):  # no other split of the work does better
        cuts = sorted(rng.uniform(0, work) for _ in range(count - 1))
        other = [b - a for a, b in itertools.pairwise([0.0, *cuts, work])]
        assert max(b + r * x for b, r, x in zip(bases, rates, other, strict=True)) >= level * (1 - 1e-12)
