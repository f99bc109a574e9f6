"""Clusters on different sites (`planner.sites`): how links cut a topology into sites, each site's share of the batch,
the outer all-reduce, and DiLoCo's prediction next to one pipeline, on random topologies and the shipped ones."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from holmes_lightning.cli.config import ModelConfig as GPTConfig
from holmes_lightning.planner import BatchSettings, ModelProfile, PlanError, PlanOptions, best_plan
from holmes_lightning.planner.sites import (
    DiLoCoSettings,
    cluster_link,
    compare_cross_site,
    outer_sync_s,
    predict_diloco,
    site_batches,
    site_groupings,
)
from holmes_lightning.topology import Topology

SMALL = ModelProfile.from_gpt(GPTConfig(name="small", n_layers=6, d_model=256, n_heads=4, seq_len=128, vocab_size=512))
SMALL_PARAMETERS = SMALL.param_bytes / 2  # bf16 weights
SPEEDS = (1, 10, 25, 100)
TOO_LITTLE_MEMORY = PlanOptions(memory_limit_gb=0.001)


def random_topology(speeds: list[int], tflops: list[int], nodes: list[int]) -> Topology:
    """len(tflops) clusters (two NIC kinds), one link speed per pair of clusters from `speeds` (reused in turn)."""
    names = [f"C{i}" for i in range(len(tflops))]
    pairs = [
        {"clusters": [a, b], "gbps": speeds[k % len(speeds)]}
        for k, (a, b) in enumerate(itertools.combinations(names, 2))
    ]
    clusters = [
        {
            "name": name,
            "nodes": count,
            "device_tflops": power,
            "nic": {"kind": ("infiniband", "roce")[i % 2], "gbps": 200},
        }
        for i, (name, power, count) in enumerate(zip(names, tflops, nodes, strict=True))
    ]
    links = {"gbps": 10, "pairs": pairs}
    return Topology.from_config({"name": "random", "devices_per_node": 1, "inter_cluster": links, "clusters": clusters})


topologies = st.integers(2, 5).flatmap(
    lambda k: st.builds(
        random_topology,
        st.lists(st.sampled_from(SPEEDS), min_size=1, max_size=10),
        st.lists(st.sampled_from([100, 150, 312]), min_size=k, max_size=k),
        st.lists(st.integers(1, 3), min_size=k, max_size=k),
    )
)


def connected(topology: Topology, site: tuple[str, ...], faster_than: float) -> bool:
    reached, frontier = {site[0]}, [site[0]]
    while frontier:
        a = frontier.pop()
        for b in site:
            if b not in reached and cluster_link(topology, a, b).gbps > faster_than:
                reached.add(b)
                frontier.append(b)
    return reached == set(site)


@settings(max_examples=150, deadline=None)
@given(topologies)
def test_each_grouping_cuts_the_slowest_links_and_keeps_sites_joined_by_faster_ones(topology):
    names = [cluster.name for cluster in topology.spec.clusters]
    groupings = site_groupings(topology)
    assert groupings[-1] == tuple((name,) for name in names)  # no link is faster than the fastest: every cluster alone
    assert [len(g) for g in groupings] == sorted({len(g) for g in groupings})  # fewest sites first, each once
    for grouping in groupings:
        assert sorted(itertools.chain(*grouping)) == sorted(names) and len(grouping) > 1
        between = [
            cluster_link(topology, a, b).gbps
            for first, second in itertools.combinations(grouping, 2)
            for a in first
            for b in second
        ]
        assert all(connected(topology, site, max(between)) for site in grouping)


@settings(max_examples=150, deadline=None)
@given(topologies, st.integers(0, 200))
def test_the_batch_is_shared_by_compute_and_every_site_trains(topology, extra):
    for grouping in site_groupings(topology):
        global_batch = len(grouping) + extra
        batches = site_batches(topology, grouping, global_batch)
        assert sum(batches) == global_batch and min(batches) >= 1
        capacity = [sum(topology.device_tflops(r.rank) for r in topology.ranks if r.cluster in s) for s in grouping]
        exact = [global_batch * c / sum(capacity) for c in capacity]
        if min(exact) >= 1:
            assert all(abs(b - e) < 1 for b, e in zip(batches, exact, strict=True))


def test_fewer_samples_than_sites_is_refused():
    topology = Topology.from_config("multi_site")
    with pytest.raises(PlanError, match="global_batch=2 is fewer samples than the 3 sites"):
        site_batches(topology, site_groupings(topology)[-1], 2)


def test_the_outer_all_reduce_crosses_the_slowest_link_of_the_ring_over_sites():
    two = Topology.from_config("two_sites_1gbps")
    seconds, link = outer_sync_s(two, (("A",), ("B",)), parameters=1e9, outer_bits=32)
    assert link == cluster_link(two, "A", "B") and seconds == pytest.approx(4e9 / link.bytes_per_s)
    three = Topology.from_config("multi_site")  # A-B 100, B-C 25, A-C 10 Gb/s: the ring's slowest hop is A-C
    seconds, link = outer_sync_s(three, (("A",), ("B",), ("C",)), parameters=1e9, outer_bits=4)
    # 4 bits are all-gathered: every other site's half byte per value, and a 4-byte scale per 128 values
    assert link == cluster_link(three, "A", "C")
    assert seconds == pytest.approx(2 * (0.5e9 + 4e9 / 128) / link.bytes_per_s)
    seconds, link = outer_sync_s(three, (("A", "B"), ("C",)), parameters=1e9, outer_bits=32)  # B-C: faster than A-C
    assert link == cluster_link(three, "B", "C") and seconds == pytest.approx(4e9 / link.bytes_per_s)


@pytest.mark.parametrize("streaming", [True, False])
def test_diloco_adds_what_its_overlapped_inner_steps_do_not_hide_once_per_outer_step(streaming):
    topology, batch = Topology.from_config("two_cluster_mixed"), BatchSettings(16)
    found = []
    for every in (1, 10, 1000):
        diloco = DiLoCoSettings(sync_every=every, streaming=streaming)
        found.append(predict_diloco(topology, SMALL, batch, (("A",), ("B",)), parameters=1e8, settings=diloco))
    for d in found:
        hidden = d.inner_step_s if streaming else 0.0  # one fragment, streamed over the next inner step
        assert d.exposed_sync_s == pytest.approx(max(d.outer_sync_s - hidden, 0.0))
        step = d.inner_step_s + d.exposed_sync_s / d.sync_every
        assert d.tokens_per_s == pytest.approx(16 * SMALL.tokens_per_sample / step)
        alone = best_plan(topology.keeping(["A-node0", "A-node1"]), SMALL, BatchSettings(d.batches[0]))
        assert d.inner_step_s >= alone.prediction.total_s  # the slowest site sets the pace
    assert [d.tokens_per_s for d in found] == sorted(d.tokens_per_s for d in found)  # rarer syncs: never slower


def test_diloco_wins_across_a_1_gbps_wan_and_one_pipeline_where_replicas_sync_every_step():
    batch = BatchSettings(16)
    wan = Topology.from_config("two_sites_1gbps")
    pipeline = best_plan(wan, SMALL, batch)
    diloco = DiLoCoSettings(sync_every=50)
    found, problems = compare_cross_site(wan, SMALL, batch, parameters=SMALL_PARAMETERS, settings=diloco)
    assert not problems and found[0].tokens_per_s > pipeline.prediction.tokens_per_s
    campus = Topology.from_config("two_cluster_mixed")
    pipeline = best_plan(campus, SMALL, batch)
    every_step = DiLoCoSettings(sync_every=1, streaming=False)
    found, _ = compare_cross_site(campus, SMALL, batch, parameters=SMALL_PARAMETERS, settings=every_step)
    assert found[0].tokens_per_s < pipeline.prediction.tokens_per_s


def test_a_site_that_cannot_plan_is_named_with_why():
    topology = Topology.from_config("multi_site")
    found, problems = compare_cross_site(
        topology, SMALL, BatchSettings(12), parameters=1e8, settings=DiLoCoSettings(), options=TOO_LITTLE_MEMORY
    )
    assert not found and len(problems) == len(site_groupings(topology))
    assert problems[0].startswith("A+B | C: ") and "memory" in problems[0]
