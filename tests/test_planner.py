"""The Holmes planner: layouts, the partition, degrees, feasibility errors and the comparison with alternatives."""

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from holmes_lightning.cli.config import ModelConfig
from holmes_lightning.measure.host import available_memory_gb
from holmes_lightning.planner import (
    Backend,
    BatchSettings,
    LayerProfile,
    LayoutKind,
    MachineCosts,
    ModelProfile,
    Plan,
    PlanError,
    PlanOptions,
    Schedule,
    SettingError,
    best_plan,
    best_plan_per_replica,
    check_batch,
    compare_plans,
)
from holmes_lightning.planner.choice import STEP_TOLERANCE
from holmes_lightning.planner.layout import StageHardware, dp_degrees, group_orders, holmes_layout, megatron_layout
from holmes_lightning.planner.options import MODELLED_SCHEDULES
from holmes_lightning.planner.report import format_plan
from holmes_lightning.planner.schedules import microbatch_problem
from holmes_lightning.topology import LinkKind, NICKind, Topology, shipped_cluster_names

GPT_7_5B = ModelProfile.from_gpt(
    ModelConfig(name="gpt_7_5b", n_layers=36, d_model=4096, n_heads=32, seq_len=2048, vocab_size=50304)
)
GPT_SMALL = ModelProfile.from_gpt(ModelConfig(name="gpt_small", n_layers=10, d_model=512, n_heads=8, seq_len=256))


def check_layout(topology: Topology, result: Plan) -> None:
    """Every rank once, equal DP sizes, every DP group in one (cluster, NIC kind), each group's stages adjacent."""
    ranks = [r for stage in result.stages for r in stage.ranks]
    assert sorted(ranks) == list(range(topology.world_size))
    assert len({len(stage.ranks) for stage in result.stages}) == 1
    group_of = {r: (info.cluster, info.nic) for r, info in enumerate(topology.ranks)}
    order = []
    for stage in result.stages:
        kinds = {group_of[r] for r in stage.ranks}
        assert {(stage.clusters, stage.nics)} == {((c,), (n,)) for c, n in kinds}, "a DP group mixes clusters or NICs"
        if not order or order[-1] != kinds:
            order.append(kinds)
    assert len(order) == len({frozenset(k) for k in order}), "a NIC group's stages are not adjacent"
    assert result.mesh_layout() == [list(stage.ranks) for stage in result.stages]
    for rank in range(topology.world_size):
        stage, index = result.coordinate(rank)
        assert result.mesh_layout()[stage][index] == rank
    layers = [layer for stage in sorted(result.stages, key=lambda s: s.index) for layer in stage.layers]
    assert sorted(layers) == list(range(result.num_layers))


@pytest.mark.parametrize("name", shipped_cluster_names())
def test_every_shipped_config_gets_a_valid_layout(name):
    topology = Topology.from_config(name)
    result = best_plan(topology, GPT_SMALL, BatchSettings(global_batch=8 * topology.world_size))
    check_layout(topology, result)
    assert Plan.from_json(result.to_json()) == result


@st.composite
def topologies(draw):
    clusters = [
        {
            "name": f"C{i}",
            "nodes": draw(st.integers(1, 3)),
            "devices_per_node": draw(st.sampled_from([1, 2, 4])),
            "device_tflops": draw(st.sampled_from([100.0, 156.0, 312.0])),
            "nic": {
                "kind": draw(st.sampled_from(["infiniband", "roce", "ethernet"])),
                "gbps": draw(st.sampled_from([25, 100, 200, 400])),
            },
        }
        for i in range(draw(st.integers(1, 4)))
    ]
    return Topology.from_config(
        {"name": "random", "clusters": clusters, "inter_cluster": {"gbps": draw(st.sampled_from([10, 100]))}}
    )


@settings(max_examples=30, deadline=None)
@given(topologies())
def test_layout_invariants_on_random_topologies(topology):
    for dp in dp_degrees(topology):
        for order in group_orders(topology):
            layout = holmes_layout(order, dp)
            assert sorted(r for stage in layout.stages for r in stage.ranks) == list(range(topology.world_size))
    fewest_stages = topology.world_size // max(dp_degrees(topology))
    if fewest_stages > GPT_SMALL.num_layers:  # e.g. 13 ranks in coprime groups: 13 stages of one rank, 12 layers
        with pytest.raises(PlanError, match=f"need {fewest_stages} layers but 'gpt_small' has 12"):
            best_plan(topology, GPT_SMALL, BatchSettings(global_batch=4 * topology.world_size))
        return
    result = best_plan(topology, GPT_SMALL, BatchSettings(global_batch=4 * topology.world_size))
    check_layout(topology, result)


def test_groups_of_one_line_rate_but_another_transport_are_both_tried_first():
    """Ethernet (TCP) and InfiniBand at 100 Gb/s deliver differently: either may be the first stage; IB and RoCE at one
    rate deliver alike and stay interchangeable (one order)."""
    clusters = [
        {"name": "A", "nodes": 2, "devices_per_node": 2, "nic": {"kind": "ethernet", "gbps": 100}},
        {"name": "B", "nodes": 2, "devices_per_node": 2, "nic": {"kind": "infiniband", "gbps": 100}},
    ]
    mixed = Topology.from_config({"name": "tcp_and_rdma", "clusters": clusters})
    assert [[g.cluster for g in order] for order in group_orders(mixed)] == [["A", "B"], ["B", "A"]]
    clusters[0]["nic"]["kind"] = "roce"
    assert len(group_orders(Topology.from_config({"name": "rdma_twice", "clusters": clusters}))) == 1


@settings(max_examples=5, deadline=None)
@given(st.lists(st.sampled_from([10, 25, 40, 100]), min_size=21, max_size=21))
def test_beyond_the_orders_searched_those_with_the_fastest_boundaries_are_kept_config_order_first(speeds):
    """Seven distinct clusters have 5,040 orders, more than MAX_GROUP_ORDERS: the kept ones are, in permutation
    order, the (at most 24) whose boundaries take the least time per byte, as each order's own links give it."""
    names = "ABCDEFG"
    clusters = [{"name": n, "nodes": 1, "nic": {"kind": "ethernet", "gbps": 100 + 10 * i}} for i, n in enumerate(names)]
    pairs = [
        {"clusters": list(pair), "gbps": g} for pair, g in zip(itertools.combinations(names, 2), speeds, strict=True)
    ]
    topology = Topology.from_config(
        {"name": "seven", "clusters": clusters, "inter_cluster": {"gbps": 100, "pairs": pairs}}
    )

    def seconds_per_byte(order):
        return sum(1 / topology.cluster_link(a.cluster, b.cluster).bytes_per_s for a, b in itertools.pairwise(order))

    every = list(itertools.permutations(topology.nic_groups()))
    best = min(map(seconds_per_byte, every))
    fastest = [order for order in every if seconds_per_byte(order) <= best * (1 + 1e-9)][:24]
    assert group_orders(topology) == fastest


def test_stage_hardware_worked_out_once_per_stage_is_the_hardware_worked_out_per_layout():
    topology = Topology.from_config("paper_4ib_4roce")
    known = {}
    layouts = [holmes_layout(order, dp) for dp in dp_degrees(topology) for order in group_orders(topology)]
    layouts += [megatron_layout(topology, topology.world_size // dp, dp) for dp in (1, 8, 64)]  # TCP communicators
    for layout in layouts:
        assert StageHardware.of(topology, layout, known) == StageHardware.of(topology, layout)
    assert len(known) < 3 * sum(layout.pp for layout in layouts)  # layouts shared what they could


def test_two_cluster_mixed_puts_one_stage_per_cluster_and_beats_the_alternatives():
    topology = Topology.from_config("two_cluster_mixed")
    plans = compare_plans(topology, GPT_7_5B, BatchSettings(global_batch=64))
    holmes = plans["holmes"]
    assert holmes.pp == 2 and holmes.dp == 2
    assert [(s.clusters, s.nics, s.dp_link) for s in holmes.stages] == [
        (("A",), (NICKind.infiniband,), LinkKind.RDMA),
        (("B",), (NICKind.roce,), LinkKind.RDMA),
    ]
    assert holmes.stages[0].send_link is LinkKind.TCP
    assert holmes.pp_links == (LinkKind.TCP, LinkKind.TCP) and holmes.rdma
    for other in ("nic_unaware", "flat_fsdp"):
        assert holmes.prediction.total_s < plans[other].prediction.total_s, other
    assert plans["homogeneous"].prediction.total_s <= holmes.prediction.total_s
    assert plans["nic_unaware"].stages[0].dp_link is LinkKind.TCP, "IB and RoCE in one job: Megatron uses sockets"
    assert not plans["nic_unaware"].rdma
    p = holmes.prediction
    assert p.compute_s + p.dp_sync_s + p.p2p_s + p.bubble_s == pytest.approx(p.total_s)
    assert p.tokens_per_s == pytest.approx(64 * 2048 / p.total_s)


def test_hostname_order_mixes_kinds_for_megatron_but_not_for_holmes():
    clusters = [
        {"name": "A", "nodes": 2, "nic": {"kind": "infiniband", "gbps": 200}, "hostnames": ["gpu1", "gpu3"]},
        {"name": "B", "nodes": 2, "nic": {"kind": "roce", "gbps": 200}, "hostnames": ["gpu2", "gpu4"]},
    ]
    topology = Topology.from_config({"name": "interleaved", "clusters": clusters})
    plans = compare_plans(topology, GPT_7_5B, BatchSettings(global_batch=64))
    assert [s.ranks for s in plans["holmes"].stages] == [(0, 1), (2, 3)]
    assert [s.ranks for s in plans["nic_unaware"].stages] == [(0, 2), (1, 3)]
    assert plans["nic_unaware"].stages[0].nics == (NICKind.infiniband, NICKind.roce)
    assert plans["nic_unaware"].stages[0].clusters == ("A", "B")
    assert any("mix" in note for note in plans["nic_unaware"].notes)
    assert plans["holmes"].speedup_over(plans["nic_unaware"]) > 1


def test_a_slower_cluster_gets_fewer_layers():
    clusters = [
        {"name": "fast", "nodes": 2, "nic": {"kind": "infiniband", "gbps": 200}},
        {"name": "slow", "nodes": 2, "device_tflops": 156, "nic": {"kind": "roce", "gbps": 200}},
    ]
    topology = Topology.from_config({"name": "mixed_speed", "clusters": clusters})
    batch = BatchSettings(global_batch=64)
    holmes = best_plan(topology, GPT_7_5B, batch, options=PlanOptions(pp=2))
    layers = {stage.clusters[0]: len(stage.layers) for stage in holmes.stages}
    assert layers["slow"] < layers["fast"]
    uniform = best_plan(topology, GPT_7_5B, batch, options=PlanOptions(pp=2, partition="uniform"))
    assert holmes.prediction.total_s < uniform.prediction.total_s
    three = best_plan(Topology.from_config("three_cluster"), GPT_7_5B, batch)
    per_cluster = {}
    for stage in three.stages:
        per_cluster.setdefault(stage.clusters[0], []).append(len(stage.layers))
    assert min(per_cluster["A"]) > max(per_cluster["C"]), per_cluster


def test_stage_order_keeps_the_slowest_link_at_one_boundary():
    three = best_plan(Topology.from_config("three_cluster"), GPT_7_5B, BatchSettings(global_batch=64))
    clusters = [s.clusters[0] for s in three.stages]
    assert clusters[0] == "C" or clusters[-1] == "C", clusters  # C (25 Gb/s) touches only one stage boundary


def test_explicit_degrees_partition_and_interleaving():
    topology = Topology.from_config("ib_only")
    result = best_plan(topology, GPT_SMALL, BatchSettings(16), options=PlanOptions(pp=2, partition=[5, 7]))
    assert (result.pp, result.dp, result.layers_per_stage(), result.partition) == (2, 2, [5, 7], "explicit")
    interleaved = best_plan(
        topology, GPT_SMALL, BatchSettings(16, microbatches=4), options=PlanOptions(pp=4, schedule="Interleaved1F1B")
    )
    assert all(len(stage.chunks) == 2 for stage in interleaved.stages)
    starts = sorted(
        (start, stage.index, j) for stage in interleaved.stages for j, (start, _) in enumerate(stage.chunks)
    )
    assert [(s, j) for _, s, j in starts] == [(s, j) for j in range(2) for s in range(4)]  # virtual stage s + j * pp
    gpipe = best_plan(topology, GPT_SMALL, BatchSettings(16), options=PlanOptions(schedule="GPipe", pp=4))
    assert gpipe.schedule == "GPipe" and gpipe.pp == 4


@pytest.mark.parametrize(
    ("cluster", "batch", "options", "expected"),
    [
        ("three_cluster", BatchSettings(64), PlanOptions(dp=4), ["dp=4", "NIC groups", "use dp in [1, 2]"]),
        ("three_cluster", BatchSettings(64), PlanOptions(pp=3), ["pp=3", "does not divide"]),
        ("ib_only", BatchSettings(64), PlanOptions(pp=2, dp=4), ["pp=2 x dp=4", "has 4"]),
        ("ib_only", BatchSettings(16, microbatches=3), PlanOptions(pp=2), ["microbatches=3", "[1, 2, 4, 8]"]),
        ("ib_only", BatchSettings(2), PlanOptions(pp=4), ["1F1B needs microbatches >= stages", "GPipe"]),
        ("ib_only", BatchSettings(6), PlanOptions(dp=4), ["global_batch=6", "multiple of 4"]),
        ("ib_only", BatchSettings(16), PlanOptions(partition=[1, 2]), ["partition=[1, 2]", "sum to"]),
        ("ib_only", BatchSettings(16), PlanOptions(pp=4, partition=[6, 6]), ["lists 2 stages", "pp=4"]),
        ("ib_only", BatchSettings(64), PlanOptions(memory_limit_gb=1.0), ["memory_limit_gb=1.0"]),
    ],
)
def test_infeasible_requests_name_the_setting_and_a_fix(cluster, batch, options, expected):
    with pytest.raises(PlanError) as caught:
        best_plan(
            Topology.from_config(cluster),
            GPT_SMALL if "memory" not in expected[0] else GPT_7_5B,
            batch,
            options=options,
        )
    for text in expected:
        assert text in str(caught.value)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: PlanOptions(pp=0), "PlanOptions(pp=0): use a positive number of stages"),
        (lambda: PlanOptions(dp=True), "PlanOptions(dp=True): use a positive DP size"),
        (lambda: PlanOptions(schedule="ZBV"), "PlanOptions(schedule='ZBV'): use one of GPipe, 1F1B, Interleaved1F1B"),
        (lambda: PlanOptions(layout="ring"), "PlanOptions(layout='ring'): use one of holmes, nic_unaware"),
        (lambda: PlanOptions(partition="even"), "PlanOptions(partition='even'): use auto, uniform, or a list"),
        (lambda: PlanOptions(partition=[2, 0]), "PlanOptions(partition=[2, 0]): use auto, uniform"),
        (lambda: PlanOptions(memory_limit_gb=0), "PlanOptions(memory_limit_gb=0): use the device memory in GB"),
        (lambda: BatchSettings(0), "BatchSettings(global_batch=0): use a positive number of samples"),
        (lambda: MachineCosts(efficiency=0), "MachineCosts(efficiency=0): use a fraction of peak > 0"),
        (lambda: MachineCosts(latency_s=-1.0), "MachineCosts(latency_s=-1.0): use seconds >= 0"),
        (lambda: MachineCosts(shared_cores=0), "MachineCosts(shared_cores=0): use the machine's core count"),
    ],
)
def test_a_bad_setting_is_refused_when_it_is_made_naming_the_field(make, expected):
    with pytest.raises(SettingError) as caught:
        make()
    assert str(caught.value).startswith(expected)


def test_settings_arrive_as_enums_and_strings_still_compare_equal():
    options = PlanOptions(schedule="GPipe", layout="nic_unaware", sharding="fsdp", backend="gloo", partition=[3, 3])
    assert options.schedule is Schedule.GPipe and options.schedule == "GPipe"
    assert (options.layout, options.sharding, options.backend) == (LayoutKind.nic_unaware, "fsdp", Backend.gloo)
    assert options.partition == (3, 3)
    assert PlanOptions(schedule="Interleaved1F1B").chunks == 2 and PlanOptions().chunks == 1


def test_more_stages_than_layers_is_an_error():
    tiny = ModelProfile.from_gpt(ModelConfig(n_layers=1, d_model=64, n_heads=4, seq_len=32))
    with pytest.raises(PlanError, match=r"pp=4 stages x 1 chunk\(s\) need 4 layers but 'gpt_tiny' has 3"):
        best_plan(Topology.from_config("ib_only"), tiny, BatchSettings(16), options=PlanOptions(pp=4))


def test_a_profile_without_costs_on_one_device_still_plans():
    unknown = ModelProfile("opaque", (LayerProfile("model", 0.0, 0.0, 1e6, 0.0, 0.0),), tokens_per_sample=1)
    topology = Topology.from_config({"name": "one", "clusters": [{"name": "x", "nodes": 1}]})
    result = best_plan(topology, unknown, BatchSettings(4), options=PlanOptions(layout="flat_fsdp"))
    assert (result.pp, result.dp, result.prediction.total_s, result.prediction.tokens_per_s) == (1, 1, 0.0, 0.0)


def test_memory_limit_pushes_the_plan_to_more_stages():
    topology = Topology.from_config("paper_4ib_4roce")
    free = best_plan(topology, GPT_7_5B, BatchSettings(2048))
    limit = free.prediction.memory_gb * 0.6
    limited = best_plan(topology, GPT_7_5B, BatchSettings(2048), options=PlanOptions(memory_limit_gb=limit))
    assert limited.prediction.memory_gb <= limit
    assert limited.pp > free.pp
    plans = compare_plans(topology, GPT_7_5B, BatchSettings(2048), options=PlanOptions(memory_limit_gb=limit))
    assert all(p.prediction.memory_gb <= limit for p in plans.values())
    for name in {"uniform", "nic_unaware", "flat_fsdp", "homogeneous"} - set(plans):
        assert any(note.startswith(f"alternative {name} is infeasible") for note in plans["holmes"].notes)


def _frozen(profile: ModelProfile, trained_share: float) -> ModelProfile:
    """`profile` with all but `trained_share` of every layer's weights frozen (LoRA: only the adapters train)."""
    layers = tuple(replace(layer, frozen_bytes=layer.param_bytes * (1 - trained_share)) for layer in profile.layers)
    return replace(profile, layers=layers)


def test_frozen_weights_are_gathered_but_get_no_gradient_sync_optimizer_step_or_state():
    """NCCL FSDP in a pipeline: a step all-gathers the weights once and reduce-scatters the gradients once; frozen
    weights only the first."""
    topology, batch = Topology.from_config("paper_4ib_4roce"), BatchSettings(2048)
    options = PlanOptions(pp=8, partition="uniform")
    costs = MachineCosts(latency_s=0.0, optimizer_s_per_gb=1.0, fsdp_optimizer_layer_s=0.0)
    trained = best_plan(topology, GPT_7_5B, batch, options=options, costs=costs)
    frozen = best_plan(topology, _frozen(GPT_7_5B, 0.0), batch, options=options, costs=costs)
    for whole, still in zip(trained.stages, frozen.stages, strict=True):
        assert still.chunks == whole.chunks
        assert still.sync_s == pytest.approx(whole.sync_s / 2)
        assert still.update_s == 0 < whole.update_s
        assert still.memory_gb < whole.memory_gb


def test_a_model_whose_weights_are_mostly_frozen_fits_a_memory_limit_on_fewer_stages():
    """Under a limit that pushes the whole model to more stages, its LoRA fine-tune (1% of the weights train) keeps
    the stages it plans without one: the planner counted frozen weights' gradients and optimizer states too."""
    topology, batch = Topology.from_config("paper_4ib_4roce"), BatchSettings(2048)
    free = best_plan(topology, GPT_7_5B, batch)
    limit = PlanOptions(memory_limit_gb=free.prediction.memory_gb * 0.6)
    assert best_plan(topology, GPT_7_5B, batch, options=limit).pp > free.pp
    assert best_plan(topology, _frozen(GPT_7_5B, 0.01), batch, options=limit).pp == free.pp


def test_gloo_fsdp_pays_an_all_reduce_for_its_reduce_scatter():
    """On gloo FSDP moves 3 (n-1)/n of the bytes, replicas 2 (n-1)/n; on NCCL both move 2 (n-1)/n."""
    topology = Topology.from_config("two_cluster_mixed")
    batch = BatchSettings(global_batch=16)

    def sync(backend: str, sharding: str) -> float:
        options = PlanOptions(pp=2, backend=backend, sharding=sharding)
        planned = best_plan(topology, GPT_SMALL, batch, options=options, costs=MachineCosts(dp_overlap=0.0))
        return sum(stage.sync_s for stage in planned.stages)

    assert sync("gloo", "fsdp") == pytest.approx(1.5 * sync("gloo", "none"))
    assert sync("nccl", "fsdp") == pytest.approx(sync("nccl", "none"))
    assert sync("gloo", "none") == pytest.approx(sync("nccl", "none"))


def test_auto_sharding_picks_replicas_on_gloo_fsdp_on_nccl_and_fsdp_when_replicas_do_not_fit():
    topology = Topology.from_config("two_cluster_mixed")
    batch = BatchSettings(global_batch=16)
    assert best_plan(topology, GPT_SMALL, batch, options=PlanOptions(backend="gloo", pp=2)).sharding == "none"
    assert best_plan(topology, GPT_SMALL, batch, options=PlanOptions(backend="nccl", pp=2)).sharding == "fsdp"
    wider = Topology.from_config("two_cluster_mixed", devices_per_node=2)  # dp=4: sharding saves memory in a pipeline
    replicas = best_plan(wider, GPT_SMALL, batch, options=PlanOptions(backend="gloo", sharding="none", pp=2))
    sharded = best_plan(wider, GPT_SMALL, batch, options=PlanOptions(backend="gloo", sharding="fsdp", pp=2))
    assert sharded.prediction.memory_gb < replicas.prediction.memory_gb
    limit = (sharded.prediction.memory_gb + replicas.prediction.memory_gb) / 2
    tight = PlanOptions(backend="gloo", pp=2, memory_limit_gb=limit, activation_checkpointing="off")
    assert best_plan(wider, GPT_SMALL, batch, options=tight).sharding == "fsdp"


def test_dp_sync_hides_only_under_a_pass_without_a_pipeline():
    topology = Topology.from_config("two_cluster_mixed")
    batch, costs = BatchSettings(global_batch=16), MachineCosts(dp_overlap=1.0)
    pipelined = best_plan(topology, GPT_SMALL, batch, options=PlanOptions(pp=2), costs=costs)
    assert all(stage.exposed_sync_s == stage.sync_s > 0 for stage in pipelined.stages)  # reduced after the schedule
    flat = best_plan(topology, GPT_SMALL, batch, options=PlanOptions(layout="flat_fsdp"), costs=costs).stages[0]
    assert flat.exposed_sync_s == pytest.approx(max(flat.sync_s - flat.forward_s[0] - flat.backward_s[0], 0.0))


def test_per_layer_overhead_makes_micro_batches_cost_something_and_the_optimizer_step_ends_the_step():
    topology = Topology.from_config("two_cluster_mixed")
    batch = BatchSettings(global_batch=32)
    free = best_plan(topology, GPT_SMALL, batch, options=PlanOptions(pp=2, sharding="none"))
    costly = best_plan(
        topology,
        GPT_SMALL,
        batch,
        options=PlanOptions(pp=2, sharding="none"),
        costs=MachineCosts(layer_overhead_s=0.05),
    )
    assert costly.microbatches < free.microbatches
    per_gb = 2.0
    timed = best_plan(
        topology,
        GPT_SMALL,
        batch,
        options=PlanOptions(pp=2, sharding="fsdp"),
        costs=MachineCosts(optimizer_s_per_gb=per_gb),
    )
    for stage in timed.stages:
        held = sum(GPT_SMALL.layers[i].param_bytes for i in stage.layers) / timed.dp
        assert stage.update_s == pytest.approx(per_gb * held / 1e9)
    p = timed.prediction
    assert p.optimizer_s > 0
    assert p.compute_s + p.dp_sync_s + p.p2p_s + p.optimizer_s + p.bubble_s == pytest.approx(p.total_s)


def test_checkpointed_layers_keep_their_input_and_run_their_forward_again():
    """GPT-small (12 pipeline layers) on ib_only, pp=2 x dp=2, GPipe over 2 micro-batches: full checkpointing adds
    each stage's forward to its backward and keeps per micro-batch only each layer's input; selective does so for
    every other layer."""
    topology, batch = Topology.from_config("ib_only"), BatchSettings(16, microbatches=2)
    settings = {"pp": 2, "partition": [6, 6], "schedule": "GPipe"}
    plans = {
        mode: best_plan(topology, GPT_SMALL, batch, options=PlanOptions(**settings, activation_checkpointing=mode))
        for mode in ("off", "full", "selective")
    }
    off, full, selective = plans["off"], plans["full"], plans["selective"]
    for plain, checkpointed in zip(off.stages, full.stages, strict=True):
        assert checkpointed.forward_s == plain.forward_s
        assert checkpointed.backward_s[0] == pytest.approx(plain.backward_s[0] + plain.forward_s[0])
        assert checkpointed.memory_gb < plain.memory_gb
        assert checkpointed.checkpointing == "full" and plain.checkpointing == "off"
    assert off.prediction.total_s < selective.prediction.total_s < full.prediction.total_s
    assert full.stages[0].memory_gb < selective.stages[0].memory_gb < off.stages[0].memory_gb
    assert Plan.from_json(full.to_json()) == full


def test_auto_checkpointing_turns_on_only_when_nothing_fits_otherwise():
    topology, batch = Topology.from_config("two_cluster_mixed"), BatchSettings(64)
    free = best_plan(topology, GPT_7_5B, batch)
    assert {stage.checkpointing for stage in free.stages} == {"off"}  # no limit: keeping activations is never slower
    with pytest.raises(PlanError, match="memory_limit_gb=20"):
        best_plan(topology, GPT_7_5B, batch, options=PlanOptions(memory_limit_gb=20, activation_checkpointing="off"))
    limited = best_plan(topology, GPT_7_5B, batch, options=PlanOptions(memory_limit_gb=20))
    assert {stage.checkpointing for stage in limited.stages} - {"off"}
    assert max(stage.memory_gb for stage in limited.stages) <= 20
    assert any("activation checkpointing turned on where keeping every activation exceeds" in n for n in limited.notes)
    roomy = best_plan(topology, GPT_7_5B, batch, options=PlanOptions(memory_limit_gb=10_000))
    assert roomy == free


def test_auto_checkpointing_is_chosen_per_stage_only_where_the_stage_needs_it():
    """GPT-7.5B on the paper's 64 GPUs within 20 GB: the first stages keep the most micro-batches in flight (1F1B) and
    checkpoint, the last ones keep everything; faster than checkpointing every stage."""
    topology, batch = Topology.from_config("paper_4ib_4roce"), BatchSettings(512)
    limited = best_plan(topology, GPT_7_5B, batch, options=PlanOptions(memory_limit_gb=20))
    modes = [stage.checkpointing for stage in limited.stages]
    assert "off" in modes and set(modes) - {"off"}, modes
    assert modes.index("off") > 0 and set(modes[modes.index("off") :]) == {"off"}  # the tail of the pipeline keeps all
    assert max(stage.memory_gb for stage in limited.stages) <= 20
    same = {"pp": limited.pp, "partition": [len(stage.layers) for stage in limited.stages], "memory_limit_gb": 20}
    batch_as_planned = BatchSettings(512, microbatches=limited.microbatches)
    everywhere = best_plan(
        topology, GPT_7_5B, batch_as_planned, options=PlanOptions(**same, activation_checkpointing="full")
    )
    assert limited.prediction.total_s < everywhere.prediction.total_s
    unbounded = {**same, "memory_limit_gb": None, "activation_checkpointing": "off"}
    kept = best_plan(topology, GPT_7_5B, batch_as_planned, options=PlanOptions(**unbounded))
    for stage, keeping in zip(limited.stages, kept.stages, strict=True):  # this very split, every activation kept
        assert keeping.layers == stage.layers
        assert (keeping.memory_gb > 20) == (stage.checkpointing != "off"), (stage.index, keeping.memory_gb)


def test_the_devices_memory_bounds_every_plan_as_the_users_limit_does():
    """A rank's device memory for training (measured at job start: `MachineCosts.device_memory_gb`) bounds the plan
    as `memory_limit_gb` does; with both, the smaller; errors and notes say which."""
    topology, batch = Topology.from_config("two_cluster_mixed"), BatchSettings(64)
    by_user = best_plan(topology, GPT_7_5B, batch, options=PlanOptions(memory_limit_gb=20))
    by_device = best_plan(topology, GPT_7_5B, batch, costs=MachineCosts(device_memory_gb=20))
    assert by_device.stages == by_user.stages and max(s.memory_gb for s in by_device.stages) <= 20
    assert any("the device's 20 GB for training" in note for note in by_device.notes)
    both = best_plan(
        topology, GPT_7_5B, batch, options=PlanOptions(memory_limit_gb=500), costs=MachineCosts(device_memory_gb=20)
    )
    assert both.stages == by_user.stages
    with pytest.raises(PlanError, match="fits the device's 0.5 GB for training"):
        best_plan(topology, GPT_7_5B, batch, costs=MachineCosts(device_memory_gb=0.5))


def test_a_hosts_available_memory_is_read_from_meminfo():
    meminfo = "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"
    assert available_memory_gb(meminfo) == pytest.approx(20000000 * 1024 / 1e9)
    assert available_memory_gb("MemTotal: 1 kB\n") is None


@settings(max_examples=15, deadline=None)
@given(topologies(), st.sampled_from([1, 2, 4]))
def test_a_dataloaders_batch_per_replica_gets_the_fastest_dp_degree(topology, replica_batch):
    """Without a global batch, each DP replica reads `replica_batch` per step: the plan is, of every DP degree's best
    plan for `replica_batch` x dp, the one of most tokens per second."""
    per_degree = []
    for dp in dp_degrees(topology):
        batch = BatchSettings(replica_batch * dp)
        try:
            per_degree.append(best_plan(topology, GPT_SMALL, batch, options=PlanOptions(dp=dp)))
        except PlanError:
            continue
    if not per_degree:
        with pytest.raises(PlanError, match=f"no feasible plan for {replica_batch} samples per DP replica"):
            best_plan_per_replica(topology, GPT_SMALL, replica_batch)
        return
    chosen = best_plan_per_replica(topology, GPT_SMALL, replica_batch)
    assert chosen.replica_batch == replica_batch and chosen.global_batch == replica_batch * chosen.dp
    assert chosen.prediction.tokens_per_s == max(plan.prediction.tokens_per_s for plan in per_degree)
    pinned = best_plan_per_replica(topology, GPT_SMALL, replica_batch, options=PlanOptions(dp=per_degree[0].dp))
    assert pinned == per_degree[0]


@pytest.mark.parametrize("cluster", ["two_cluster_mixed", "multi_site"])
def test_schedule_auto_takes_the_best_schedule_and_lists_each(cluster: str) -> None:
    """`auto` plans every modelled schedule: the plan it returns is within the step tolerance of the fastest of them
    (the least memory of those), and its notes give each schedule's predicted step and bubble."""
    topology, batch = Topology.from_config(cluster), BatchSettings(global_batch=32)
    each = {
        schedule: best_plan(topology, GPT_SMALL, batch, options=PlanOptions(schedule=schedule))
        for schedule in MODELLED_SCHEDULES
    }
    chosen = best_plan(topology, GPT_SMALL, batch, options=PlanOptions(schedule="auto"))
    fastest = min(plan.prediction.total_s for plan in each.values())
    assert chosen.schedule in MODELLED_SCHEDULES
    assert chosen.prediction.total_s <= fastest * (1 + STEP_TOLERANCE)
    assert chosen == replace(each[chosen.schedule], notes=chosen.notes)
    for schedule, plan in each.items():
        assert f"schedule {schedule.value}: step {plan.prediction.total_s:.4g} s" in "\n".join(chosen.notes)
    assert replace(chosen, schedule="1F1B").schedule is Schedule["1F1B"]  # a plan written by hand names it as text
    with pytest.raises(ValueError, match="a Plan runs one schedule, not schedule='auto'"):
        replace(chosen, schedule="auto")


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_layers_given_per_stage_are_split_into_each_stages_chunks(schedule):
    topology, profile = Topology.from_config("two_cluster_mixed"), ModelProfile.from_gpt(ModelConfig(n_layers=6))
    plan = best_plan(
        topology, profile, BatchSettings(16), options=PlanOptions(schedule=schedule, pp=2, partition=[4, 4])
    )
    assert [sum(stop - start for start, stop in stage.chunks) for stage in plan.stages] == [4, 4]
    assert all(len(stage.chunks) == 2 for stage in plan.stages)


def test_the_plan_table_keeps_its_columns_when_a_stage_holds_several_chunks() -> None:
    """A V stage's two chunks, named, are longer than the layers column was: the next column still lines up."""
    plan = best_plan(
        Topology.from_config("two_cluster_mixed"),
        GPT_SMALL,
        BatchSettings(16),
        options=PlanOptions(schedule=Schedule("DualPipeV"), pp=2),
    )
    lines = format_plan(plan, GPT_SMALL).splitlines()
    column = next(line for line in lines if "DP group link" in line).index("DP group link")
    rows = [line for line in lines if line.startswith(("  0 ", "  1 "))]
    assert len(rows) == 2 and all(len(row.split(";")) == 2 for row in rows)  # two chunks per stage
    assert all(row[column - 2 : column] == "  " and row[column:].startswith("rdma ") for row in rows)


@settings(max_examples=60, deadline=None)
@given(
    schedule=st.sampled_from(MODELLED_SCHEDULES),
    pp=st.sampled_from([1, 2, 4]),
    microbatches=st.integers(1, 8),
    size=st.integers(1, 4),
    samples=st.integers(1, 40),
)
def test_a_batch_of_any_size_runs_in_equal_micro_batches_no_larger_than_planned(
    schedule, pp, microbatches, size, samples
):
    """An epoch's short last batch (or an evaluation batch) splits evenly, into micro-batches of at most the planned
    size; the plan's own micro-batches come first where they split it; a training split is the first the schedule
    takes, else the first (which a schedule taking any count runs)."""
    plan = replace(best_plan(Topology.from_config("ib_only"), GPT_SMALL, BatchSettings(16)), schedule=schedule)
    plan = replace(plan, stages=plan.stages[:1] * pp, microbatches=microbatches, microbatch_size=size)
    counts = plan.microbatch_counts(samples)
    assert counts and all(samples % count == 0 for count in counts)
    assert counts[0] == microbatches if samples % microbatches == 0 else samples // counts[0] <= size
    assert all(samples // count <= size for count in counts[1:])
    training = plan.training_microbatches(samples)
    accepted = [count for count in counts if microbatch_problem(schedule, pp, count) is None]
    assert training == (accepted[0] if accepted else counts[0])


@settings(max_examples=80, deadline=None)
@given(
    topology=topologies(),
    global_batch=st.integers(1, 24),
    microbatches=st.none() | st.integers(1, 6),
    pp=st.none() | st.integers(1, 4),
    schedule=st.sampled_from(["GPipe", "1F1B", "Interleaved1F1B", "DualPipeV", "auto"]),
)
def test_the_batch_check_before_launch_never_refuses_a_job_the_planner_plans(
    topology, global_batch, microbatches, pp, schedule
):
    """`check_batch` runs without a model before any process starts: what it refuses, no plan could run."""
    options, batch = PlanOptions(pp=pp, schedule=schedule), BatchSettings(global_batch, microbatches=microbatches)
    try:
        best_plan(topology, GPT_SMALL, batch, options=options)
    except PlanError:
        return
    check_batch(topology, options, batch)


def activation(after: LayerProfile) -> LayerProfile:
    """A parameterless layer (an activation) after `after`: elementwise compute, its output as big as its input."""
    size = after.activation_bytes
    return LayerProfile(f"act_after_{after.name}", size, 2 * size, 0.0, size, size)


def mlp_with_activations(blocks: int, width: int) -> ModelProfile:
    """Linear, activation, ..., Linear: an nn.Sequential as users write one, its activations layers of their own."""
    layers: list[LayerProfile] = []
    for i in range(blocks):
        linear = LayerProfile(f"linear{i}", 2.0 * width**2, 4.0 * width**2, 4.0 * width**2, 4.0 * width, 4.0 * width)
        layers += [linear, activation(linear)]
    layers.append(LayerProfile("out", 20.0 * width, 40.0 * width, 40.0 * width, 40.0, 40.0))
    return ModelProfile("mlp", tuple(layers), tokens_per_sample=1)


def check_every_stage_holds_parameters(plan: Plan, profile: ModelProfile) -> None:
    """The chunks cover the model's own layers once, in order, and every stage's ranks hold some parameters."""
    assert plan.num_layers == profile.num_layers
    ranges = sorted(chunk for stage in plan.stages for chunk in stage.chunks)
    assert [start for start, _ in ranges] == [0, *(stop for _, stop in ranges[:-1])]
    assert ranges[-1][1] == profile.num_layers
    for stage in plan.stages:
        assert any(profile.layers[layer].param_bytes for layer in stage.layers), (stage.index, stage.chunks)


def test_a_plan_never_leaves_a_stage_only_parameterless_layers() -> None:
    """Without them the cost model puts an activation alone on a stage here (pp=4: [[0, 1], [2], [3], [4]]): a
    stage with nothing to sync or update costs little, but its ranks' optimizer would hold no parameters."""
    profile = mlp_with_activations(blocks=2, width=1024)
    plan = best_plan(Topology.from_config("two_cluster_mixed"), profile, BatchSettings(global_batch=32))
    check_every_stage_holds_parameters(plan, profile)


@settings(max_examples=25, deadline=None)
@given(
    topology=topologies(),
    after=st.lists(st.integers(0, 2), min_size=GPT_SMALL.num_layers, max_size=GPT_SMALL.num_layers),
    schedule=st.sampled_from(["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"]),
)
def test_parameterless_layers_anywhere_never_make_a_stage_of_their_own(topology, after, schedule) -> None:
    """Activations drawn after GPT_SMALL's layers (0-2 after each): every plan's stages each hold parameters, and
    the planner refuses the model only where it refuses GPT_SMALL alone (the layers stages may start at)."""
    pairs = zip(GPT_SMALL.layers, after, strict=True)
    layers = [item for layer, n in pairs for item in (layer, *[activation(layer)] * n)]
    profile = ModelProfile("gpt_small_with_activations", tuple(layers), GPT_SMALL.tokens_per_sample)
    batch, options = BatchSettings(4 * topology.world_size), PlanOptions(schedule=schedule)
    try:
        plan = best_plan(topology, profile, batch, options=options)
    except PlanError:
        with pytest.raises(PlanError):
            best_plan(topology, GPT_SMALL, batch, options=options)
        return
    check_every_stage_holds_parameters(plan, profile)
