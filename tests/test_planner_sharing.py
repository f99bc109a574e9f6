"""Ranks that share CPU cores (`planner.sharing`): hand-computed steps, and what must hold on any pipeline."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from holmes_lightning.planner import (
    BatchSettings,
    MachineCosts,
    PlanOptions,
    Sharding,
    best_plan,
    on_shared_cores,
    simulate,
)
from holmes_lightning.planner.profile import LayerProfile, ModelProfile
from holmes_lightning.planner.sharing import CoreSharing
from holmes_lightning.planner.simulate import Replay
from holmes_lightning.topology import Topology
from tests.test_planner_simulate import passes, stages


def test_one_core_runs_two_stages_of_gpipe_back_to_back():
    """GPipe, 2 stages, 2 micro-batches, 1 s per pass, one core: whenever both stages have work they halve it, and
    the core never idles, so the step is the 8 s of work (alone: 6 s)."""
    timeline = simulate(stages([1.0, 1.0], [1.0, 1.0]), "GPipe", 2, shared_cores=1)
    assert timeline.total_s == pytest.approx(8.0, rel=1e-4)
    first, second = passes(timeline)
    assert [round(end, 3) for *_, end in first] == [1.0, 3.0, 7.0, 8.0]  # F0 alone, F1 beside stage 1's F0, ...
    assert [round(end, 3) for *_, end in second] == [3.0, 4.0, 5.0, 7.0]
    assert simulate(stages([1.0, 1.0], [1.0, 1.0]), "GPipe", 2).total_s == 6.0


def test_a_core_per_rank_changes_nothing():
    alone = simulate(stages([1.0, 2.0, 1.5], [2.0, 3.0, 2.5], sends=[0.3, 0.2, 0.0]), "1F1B", 5)
    shared = simulate(stages([1.0, 2.0, 1.5], [2.0, 3.0, 2.5], sends=[0.3, 0.2, 0.0]), "1F1B", 5, shared_cores=3)
    assert shared == alone


SCHEDULES = st.sampled_from([("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)])


@settings(max_examples=60, deadline=None)
@given(
    schedule=SCHEDULES,
    pp=st.integers(1, 4),
    extra=st.integers(0, 4),
    ranks=st.integers(1, 3),
    cores=st.sampled_from([1, 2, 3, 4.5]),
    seconds=st.lists(st.floats(0.1, 3.0), min_size=24, max_size=24),
)
def test_shared_cores_step_lies_between_every_rank_alone_and_every_rank_slowed(
    schedule, pp, extra, ranks, cores, seconds
):
    """Sharing only slows a pass (no faster than alone), at worst to cores / ranks (all computing at once), and the
    step holds at least all the work the cores must do."""
    name, chunks = schedule
    m = pp * (1 + extra // 2) if name == "Interleaved1F1B" else 1 + extra
    replay = Replay.of(name, pp, m, chunks)
    virtual = pp * chunks
    forward, backward, send = seconds[:virtual], seconds[8 : 8 + virtual], [s / 4 for s in seconds[16 : 16 + virtual]]
    sharing = CoreSharing(cores, ranks)
    durations, _, clock = replay.shared(forward, backward, send, sharing)
    slowest = max(1.0, ranks * pp / cores)
    alone = replay.seconds(forward, backward)
    assert all(a * (1 - 1e-9) <= d <= a * slowest * (1 + 1e-9) for a, d in zip(alone, durations, strict=True))
    assert max(clock) >= max(replay.ends(forward, backward, send)[1]) * (1 - 1e-9)
    all_busy = replay.ends([f * slowest for f in forward], [b * slowest for b in backward], send)[1]
    assert max(clock) <= max(all_busy) * (1 + 1e-6)
    assert max(clock) >= ranks * sum(alone) / cores * (1 - 1e-3)


def test_planner_predicts_with_the_sharing_it_was_given():
    """A plan made for ranks on 2 shared cores is predicted by the shared simulator, and no slower than the same
    job planned as if every rank computed at cores / ranks all the time."""
    topology = Topology.from_config("two_cluster_mixed")
    layers = (LayerProfile("embed", 1e9, 2e9, 4e6, 1e5, 2e5),) + tuple(
        LayerProfile(f"block{i}", 4e10, 8e10, 8e6, 1e5, 4e5) for i in range(6)
    )
    profile = ModelProfile("toy", layers, tokens_per_sample=64)
    batch = BatchSettings(16)
    shared = best_plan(
        topology, profile, batch, options=PlanOptions(backend="gloo", pp=2), costs=MachineCosts(shared_cores=2)
    )
    assert shared.shared_cores == 2
    replayed = simulate(
        shared.stages, shared.schedule, shared.microbatches, shared_cores=shared.shared_cores, backend=shared.backend
    )
    assert shared.prediction.total_s == pytest.approx(replayed.total_s, rel=1e-9)
    world = topology.world_size
    slowed = best_plan(
        topology,
        profile,
        batch,
        options=PlanOptions(backend="gloo", pp=2),
        costs=MachineCosts(efficiency=0.5 * 2 / world),
    )
    assert shared.prediction.total_s <= slowed.prediction.total_s * (1 + 1e-6)


def test_shared_cores_must_be_positive():
    topology = Topology.from_config("two_cluster_mixed")
    profile = ModelProfile("toy", (LayerProfile("a", 1e9, 2e9, 1e6, 1e5, 1e5),) * 4, tokens_per_sample=8)
    with pytest.raises(ValueError, match=r"MachineCosts\(shared_cores=0\): use the machine's core count"):
        best_plan(topology, profile, BatchSettings(8), options=PlanOptions(), costs=MachineCosts(shared_cores=0))


@pytest.mark.parametrize("schedule", ["1F1B", "InterleavedZeroBubble"])
def test_a_plan_for_a_device_per_rank_runs_no_slower_on_shared_cores(schedule):
    """A plan made for 4 devices each at half of one of 2 cores, run with the 4 ranks sharing the 2 cores: same layout,
    no slower (a rank computing alone gets a whole core), and no faster than all its work on 2 cores (a zero-bubble
    schedule's weight passes at the same share as the rest)."""
    topology = Topology.from_config("two_cluster_mixed")
    layers = tuple(LayerProfile(f"block{i}", 4e10, 8e10, 8e6, 1e6, 4e6) for i in range(6))
    profile = ModelProfile("toy", layers, tokens_per_sample=64)
    devices = best_plan(
        topology,
        profile,
        BatchSettings(16),
        options=PlanOptions(backend="gloo", pp=2, schedule=schedule),
        costs=MachineCosts(efficiency=0.25),
    )
    shared = on_shared_cores(devices, profile, cores=2, share=0.5)
    assert [s.ranks for s in shared.stages] == [s.ranks for s in devices.stages]
    assert [s.weight_s for s in shared.stages] == [tuple(w * 0.5 for w in s.weight_s) for s in devices.stages]
    assert shared.prediction.total_s <= devices.prediction.total_s * (1 + 1e-9)
    work = sum(len(s.ranks) * shared.microbatches * (sum(s.forward_s) + sum(s.backward_s)) for s in shared.stages)
    assert shared.prediction.total_s >= work / 2 * (1 - 1e-3)
    assert shared.shared_cores == 2


def test_moving_bytes_on_shared_cores_costs_the_cores_what_each_byte_takes():
    """Flat replicas of 4 ranks on 2 cores all-reduce 2 x 3/4 of the model's bytes out of every rank at once: with
    `transfer_cpu_s_per_byte` c the step grows by c x 4 x 1.5 x bytes / 2 cores; a pipeline's sends join the passes
    that make them, the first stage's forward and the second's backward."""
    topology = Topology.from_config("two_cluster_mixed")
    layers = tuple(LayerProfile(f"block{i}", 4e10, 8e10, 8e6, 1e6, 4e6) for i in range(6))
    profile = ModelProfile("toy", layers, tokens_per_sample=64)
    batch, c = BatchSettings(16), 1e-8
    flat = PlanOptions(backend="gloo", layout="flat_fsdp", sharding=Sharding.none)
    replicas = best_plan(topology, profile, batch, options=flat, costs=MachineCosts(efficiency=0.25, dp_overlap=0.0))
    free, costly = (on_shared_cores(replicas, profile, cores=2, share=0.5, transfer_cpu_s_per_byte=x) for x in (0, c))
    added = c * 4 * 1.5 * profile.param_bytes / 2
    assert costly.prediction.total_s == pytest.approx(free.prediction.total_s + added)
    assert costly.prediction.dp_sync_s == pytest.approx(free.prediction.dp_sync_s + added)

    piped = best_plan(
        topology,
        profile,
        batch,
        options=PlanOptions(backend="gloo", pp=2),
        costs=MachineCosts(efficiency=0.25, dp_overlap=0.0),
    )
    free, costly = (on_shared_cores(piped, profile, cores=2, share=0.5, transfer_cpu_s_per_byte=x) for x in (0, c))
    (_, boundary), mb = piped.stages[0].chunks[0], piped.microbatch_size
    message_s = c * layers[boundary - 1].activation_bytes * mb
    for stage, added_s in ((0, [message_s, 0.0]), (1, [0.0, message_s])):  # (forward, backward) of its one chunk
        before, after = free.stages[stage], costly.stages[stage]
        moved = [after.forward_s[0] - before.forward_s[0], after.backward_s[0] - before.backward_s[0]]
        assert moved == pytest.approx(added_s)
    assert costly.prediction.total_s > free.prediction.total_s


def test_a_pipeline_messages_cpu_joins_the_pass_that_sends_it_on_shared_cores_only():
    """Interleaved 1F1B on 2 stages: 4 virtual stages, each forward but the last sends, each backward but the first;
    with `message_cpu_s` c those passes take c longer, on ranks that share cores (a device's compute loses nothing)."""
    topology = Topology.from_config("two_cluster_mixed")
    layers = tuple(LayerProfile(f"block{i}", 4e10, 8e10, 8e6, 1e6, 4e6) for i in range(8))
    profile = ModelProfile("toy", layers, tokens_per_sample=64)
    options = PlanOptions(backend="gloo", pp=2, schedule="Interleaved1F1B", partition=[2, 2, 2, 2])
    c = 0.003
    for cores, added in ((2, c), (None, 0.0)):
        shared = MachineCosts(efficiency=0.25, shared_cores=cores)
        batch = BatchSettings(16, microbatches=4)
        free, costly = (
            best_plan(topology, profile, batch, options=options, costs=replace(shared, message_cpu_s=x))
            for x in (0.0, c)
        )
        for stage, (first, second) in enumerate(zip(free.stages, costly.stages, strict=True)):
            virtual = (stage, stage + 2)  # loop placement
            forward = [added if v < 3 else 0.0 for v in virtual]
            backward = [added if v > 0 else 0.0 for v in virtual]
            moved_forward = [b - a for a, b in zip(first.forward_s, second.forward_s, strict=True)]
            moved_backward = [b - a for a, b in zip(first.backward_s, second.backward_s, strict=True)]
            assert moved_forward == pytest.approx(forward) and moved_backward == pytest.approx(backward)
        assert (costly.prediction.total_s > free.prediction.total_s) == (cores is not None)
