from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from holmes_lightning.topology import (
    ClusterGroupSpec,
    ClusterPairSpec,
    ClusterSpec,
    InterClusterSpec,
    LinkKind,
    LinkScope,
    NICKind,
    NICSpec,
    Topology,
    TopologyError,
    shipped_cluster_names,
)


def test_shipped_configs_are_the_documented_set():
    expected = {"single_node", "two_cluster_mixed", "ib_only", "roce_only", "ethernet_only", "three_cluster"}
    assert expected <= set(shipped_cluster_names())


@pytest.mark.parametrize("name", shipped_cluster_names())
def test_every_shipped_config_obeys_the_link_rules(name):
    topology = Topology.from_config(name)
    assert [r.rank for r in topology.ranks] == list(range(topology.world_size))
    for a in range(topology.world_size):
        for b in range(topology.world_size):
            if a == b:
                continue
            link, ra, rb = topology.link(a, b), topology.ranks[a], topology.ranks[b]
            assert link == topology.link(b, a)
            if ra.node == rb.node:
                assert link.kind is LinkKind.INTRA_NODE
            elif ra.cluster == rb.cluster and ra.nic.is_rdma:
                assert link.kind is LinkKind.RDMA
            else:
                assert link.kind is LinkKind.TCP
            if ra.nic is not rb.nic and ra.nic.is_rdma and rb.nic.is_rdma:
                assert link.kind is LinkKind.TCP, "IB and RoCE never talk RDMA"
    assert "Topology" in str(topology)


def test_two_cluster_mixed_matches_the_paper_setting():
    topology = Topology.from_config("two_cluster_mixed")
    assert topology.world_size == 4
    assert [(g.cluster, g.nic, g.ranks) for g in topology.nic_groups()] == [
        ("A", NICKind.infiniband, (0, 1)),
        ("B", NICKind.roce, (2, 3)),
    ]
    assert topology.link(0, 1).kind is LinkKind.RDMA and topology.link(0, 1).line_gbps == 200
    assert topology.link(0, 1).gbps == pytest.approx(200 * 0.9)  # what RDMA delivers of its line rate
    assert topology.link(1, 2).kind is LinkKind.TCP and topology.link(1, 2).line_gbps == 100
    assert topology.link(0, 1, rdma=False).kind is LinkKind.TCP
    summary = str(topology)
    for word in ("A-node0", "infiniband", "roce", "rdma", "tcp"):
        assert word in summary


def test_devices_per_node_override_top_level_and_per_cluster():
    assert Topology.from_config("two_cluster_mixed", devices_per_node=8).world_size == 32
    spec = {
        "name": "x",
        "devices_per_node": 2,
        "clusters": [
            {"name": "A", "nodes": 2, "nic": {"kind": "infiniband", "gbps": 200}},
            {"name": "B", "nodes": 1, "devices_per_node": 4, "nic": {"kind": "roce", "gbps": 100}},
        ],
    }
    topology = Topology.from_config(spec)
    assert topology.world_size == 8
    assert topology.link(0, 1).kind is LinkKind.INTRA_NODE
    assert topology.ranks[7].local_device == 3 and topology.ranks[7].cluster == "B"


def test_sources_agree(tmp_path: Path):
    from holmes_lightning.topology import config_dir, load_cluster_spec

    path = config_dir() / "cluster" / "three_cluster.yaml"
    by_name = Topology.from_config("three_cluster")
    assert Topology.from_config(path) == by_name
    assert Topology.from_config(load_cluster_spec(path)) == by_name
    assert Topology.from_dict(by_name.to_dict()) == by_name


def test_homogeneous_limit_sets_every_link_to_the_fastest_nic():
    topology = Topology.from_config("three_cluster").homogeneous()
    speeds = {topology.link(a, b).gbps for a in range(8) for b in range(8) if a != b}
    assert speeds == {400 * 0.9}  # every link as InfiniBand delivers it, between clusters too


def test_measured_bandwidths_replace_configured(tmp_path: Path):
    measured = tmp_path / "probe.json"
    measured.write_text('{"links": {"rdma:A": 180.5, "inter_cluster": 42}}')
    topology = Topology.from_config("two_cluster_mixed", measured=str(measured))
    assert topology.link(0, 1).gbps == 180.5 and topology.link(0, 2).gbps == 42
    assert topology.link(0, 1).line_gbps is None  # measured: what was delivered, no efficiency applied
    assert topology.link(2, 3).gbps == pytest.approx(180.0) and topology.link(2, 3).line_gbps == 200


def test_each_transport_delivers_its_share_of_line_rate_unless_measured():
    topology = Topology.from_config("two_cluster_mixed", transport_efficiency={"tcp": 0.3})
    assert topology.link(0, 2).gbps == pytest.approx(30) and topology.link(0, 2).line_gbps == 100
    assert topology.link(0, 1).gbps == pytest.approx(180)  # the others keep their defaults
    with pytest.raises(TopologyError, match=r"cluster.transport_efficiency.tcp=1.5: .* in \(0, 1\]"):
        Topology.from_config("two_cluster_mixed", transport_efficiency={"tcp": 1.5})


def _multisite(pairs=None, gbps=10):
    """Three sites: A-B 100 Gb/s, B-C 25, A-C the default (`pairs` replaces the list)."""
    clusters = [
        {"name": "A", "nodes": 2, "nic": {"kind": "infiniband", "gbps": 200}},
        {"name": "B", "nodes": 2, "nic": {"kind": "roce", "gbps": 200}},
        {"name": "C", "nodes": 2, "nic": {"kind": "ethernet", "gbps": 100}},
    ]
    default = [{"clusters": ["A", "B"], "gbps": 100}, {"clusters": ["C", "B"], "gbps": 25}]
    return {
        "name": "sites",
        "clusters": clusters,
        "inter_cluster": {"gbps": gbps, "pairs": default if pairs is None else pairs},
    }


def _cluster(**overrides):
    base = {"name": "bad", "clusters": [{"name": "A", "nodes": 2, "nic": {"kind": "infiniband", "gbps": 200}}]}
    base.update(overrides)
    return base


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_cluster(clusters=[{"name": "A", "nodes": 1, "nic": {"kind": "omnipath"}}]), "clusters[0].nic.kind: Invalid"),
        (_cluster(clusters=[{"name": "A", "nodes": 1, "nic": {"kind": "roce", "gbps": 0}}]), "nic.gbps=0"),
        (_cluster(clusters=[{"name": "A", "nodes": 0}]), "clusters[0].nodes=0"),
        (_cluster(devices_per_node=-1), "devices_per_node=-1"),
        (_cluster(clusters=[]), "`clusters` is empty"),
        (_cluster(clusters=[{"name": "A"}, {"name": "A"}]), "used twice"),
        (_cluster(clusters=[{"name": "A", "nodes": 2, "hostnames": ["h1"]}]), "hostnames has 1 names"),
        (_cluster(inter_cluster={"gbps": -5}), "inter_cluster.gbps=-5"),
        (_cluster(clusters=[{"name": "A", "nodez": 2}]), "nodez"),
        (_cluster(devices_per_node="eight"), "devices_per_node"),
        (_cluster(inter_cluster={"pairs": [{"clusters": ["A", "Z"], "gbps": 5}]}), "pairs[0].clusters: ['Z']"),
        (_cluster(inter_cluster={"pairs": [{"clusters": ["A", "A"], "gbps": 5}]}), "two different clusters"),
        (_cluster(inter_cluster={"pairs": [{"clusters": ["A"], "gbps": 5}]}), "pairs[0].clusters=['A']"),
        (_cluster(inter_cluster={"pairs": [{"clusters": ["A", "B"], "gbz": 5}]}), "gbz"),
        (_multisite(pairs=[{"clusters": ["A", "B"], "gbps": 0}]), "pairs[0].gbps=0"),
        (
            _multisite(pairs=[{"clusters": ["A", "B"], "gbps": 5}, {"clusters": ["B", "A"], "gbps": 6}]),
            "pairs[1]: the pair ['A', 'B'] is already given by inter_cluster.pairs[0]",
        ),
    ],
)
def test_invalid_configs_name_the_field(config, message):
    with pytest.raises(TopologyError, match=None) as err:
        Topology.from_config(config)
    assert message in str(err.value)


def test_unknown_config_name_lists_the_shipped_ones():
    with pytest.raises(TopologyError, match="two_cluster_mixed"):
        Topology.from_config("two_clusters")


def test_world_size_mismatch_says_how_to_fix():
    with pytest.raises(TopologyError, match="devices_per_node"):
        Topology.from_config("two_cluster_mixed").check_world_size(8)


cluster_groups = st.lists(
    st.tuples(
        st.integers(1, 4),
        st.integers(1, 4),
        st.sampled_from(list(NICKind)),
        st.sampled_from([25.0, 100.0, 200.0, 400.0]),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=60, deadline=None)
@given(groups=cluster_groups, inter=st.sampled_from([10.0, 50.0, 100.0]))
def test_random_shapes_keep_the_invariants(groups, inter):
    spec = ClusterSpec(
        name="random",
        clusters=[
            ClusterGroupSpec(name=f"c{i}", nodes=nodes, devices_per_node=devices, nic=NICSpec(kind.value, gbps))
            for i, (nodes, devices, kind, gbps) in enumerate(groups)
        ],
    )
    spec.inter_cluster.gbps = inter
    topology = Topology(spec)
    assert topology.world_size == sum(n * d for n, d, _, _ in groups)
    node_ranks = [r for node in topology.nodes for r in node.ranks]
    assert sorted(node_ranks) == list(range(topology.world_size)), "every rank on exactly one node"
    grouped = [r for g in topology.nic_groups() for r in g.ranks]
    assert sorted(grouped) == list(range(topology.world_size)), "NIC groups partition the ranks"
    for group in topology.nic_groups():
        assert {topology.ranks[r].nic for r in group.ranks} == {group.nic}
        assert {topology.ranks[r].cluster for r in group.ranks} == {group.cluster}
    for a in range(topology.world_size):
        for b in range(a + 1, topology.world_size):
            link = topology.link(a, b)
            assert link == topology.link(b, a) and link.gbps > 0
            if topology.ranks[a].cluster != topology.ranks[b].cluster:
                assert link.kind is LinkKind.TCP and link.gbps <= inter


def test_inter_cluster_speed_per_pair_of_clusters(tmp_path: Path):
    topology = Topology.from_config(_multisite())
    a, b, c = 0, 2, 4  # a rank of each cluster
    assert topology.link(a, b) == topology.link(b, a) == Topology.from_config(_multisite()).link(a, b)
    lines = (topology.link(a, b).line_gbps, topology.link(b, c).line_gbps, topology.link(a, c).line_gbps)
    assert lines == (100, 25, 10)
    assert topology.link(a, b).kind is LinkKind.TCP
    assert topology.link(0, 1, rdma=False).line_gbps == 10, "TCP forced inside a cluster runs on the default Ethernet"
    assert [str(topology.link_class(*pair)) for pair in ((a, b), (c, b), (a, c), (0, 1))] == [
        "inter_cluster:A<->B",
        "inter_cluster:B<->C",
        "inter_cluster",
        "rdma:A",
    ]
    listed = topology.link_class(a, b)
    assert (listed.scope, listed.clusters, listed.pair_listed) == (LinkScope.inter_cluster, ("A", "B"), True)
    summary = str(topology)
    for text in ("inter_cluster:A<->B", "A<->C", "100 Gb/s", "25 Gb/s", "10 Gb/s"):
        assert text in summary
    assert topology.slowest_link((a, b, c)).line_gbps == 10
    assert topology.slowest_link((0, 1, b)).line_gbps == 100
    spec = ClusterSpec(
        name="typed",
        clusters=[ClusterGroupSpec(name=n, nic=NICSpec("roce", 200)) for n in "XY"],
        inter_cluster=InterClusterSpec(50, [ClusterPairSpec(["Y", "X"], 20)]),
    )
    assert Topology(spec).link(0, 1).line_gbps == 20
    assert Topology(replace(spec, inter_cluster=spec.inter_cluster.scaled(0.5))).link(0, 1).line_gbps == 10
    measured = tmp_path / "probe.json"
    measured.write_text('{"links": {"inter_cluster:A<->B": 60, "inter_cluster": 7}}')
    probed = Topology.from_config(_multisite() | {"measured": str(measured)})
    assert (probed.link(a, b).gbps, probed.link(b, c).gbps, probed.link(a, c).gbps) == (60, 7, 7)


@settings(max_examples=40, deadline=None)
@given(
    groups=cluster_groups,
    pair_speeds=st.lists(st.sampled_from([5.0, 25.0, 400.0]), min_size=6, max_size=6),
    data=st.data(),
)
def test_slowest_link_per_class_matches_every_pair(groups, pair_speeds, data):
    names = [f"c{i}" for i in range(len(groups))]
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    listed = data.draw(st.lists(st.sampled_from(pairs), unique=True)) if pairs else []
    spec = ClusterSpec(
        name="random",
        clusters=[
            ClusterGroupSpec(name=name, nodes=nodes, devices_per_node=devices, nic=NICSpec(kind.value, gbps))
            for name, (nodes, devices, kind, gbps) in zip(names, groups, strict=True)
        ],
        inter_cluster=InterClusterSpec(
            50.0, [ClusterPairSpec(list(p), s) for p, s in zip(listed, pair_speeds, strict=False)]
        ),
    )
    topology = Topology(spec)
    if topology.world_size < 2:
        return
    ranks = data.draw(st.lists(st.sampled_from(range(topology.world_size)), min_size=2, unique=True))
    for rdma in (True, False):
        every_pair = [topology.link(a, b, rdma) for i, a in enumerate(ranks) for b in ranks[i + 1 :]]
        slowest = topology.slowest_link(ranks, rdma)
        assert slowest.gbps == min(link.gbps for link in every_pair)
        assert slowest in every_pair
        if any(link.kind is LinkKind.TCP and link.gbps == slowest.gbps for link in every_pair):
            assert slowest.kind is LinkKind.TCP, "on equal speed a TCP hop decides the transport"
    text = str(topology)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert f"{a}<->{b}" in text


def test_a_measured_speed_may_name_its_own_pair_of_clusters():
    """three_cluster: A-B and A-C are unlisted inter-cluster pairs, both `inter_cluster`; a speed measured for one
    pair (`inter_cluster:A<->C`) sets that pair alone, the generic key the others, a listed pair's key its own."""
    topology = Topology.from_config("three_cluster")
    a, b, c = (topology.nic_groups()[i].ranks[0] for i in range(3))
    probed = Topology(topology.spec, {"inter_cluster:A<->C": 3.0, "inter_cluster": 7.0})
    assert (probed.link(a, c).gbps, probed.link(a, b).gbps) == (3.0, 7.0)
    assert topology.link_class(a, c).measured_keys == ("inter_cluster:A<->C", "inter_cluster")
    assert topology.link_class(a, a + 1).measured_keys == ("rdma:A",)


def test_a_cluster_less_some_nodes_keeps_its_clusters_links_and_hostnames():
    clusters = [
        {"name": "A", "nodes": 2, "nic": {"kind": "infiniband", "gbps": 200}, "hostnames": ["a1", "a2"]},
        {"name": "B", "nodes": 1, "nic": {"kind": "roce", "gbps": 200}},
        {"name": "C", "nodes": 2, "nic": {"kind": "ethernet", "gbps": 100}},
    ]
    pairs = [{"clusters": ["A", "B"], "gbps": 50}, {"clusters": ["A", "C"], "gbps": 25}]
    topology = Topology.from_config(
        {"name": "sites", "clusters": clusters, "inter_cluster": {"gbps": 10, "pairs": pairs}}
    )
    survivors = topology.without(["a1", "B-node0"])
    assert [(n.name, n.cluster) for n in survivors.nodes] == [("a2", "A"), ("C-node0", "C"), ("C-node1", "C")]
    assert [list(p.clusters) for p in survivors.spec.inter_cluster.pairs] == [["A", "C"]]
    assert survivors.link(0, 1).line_gbps == 25 and survivors.world_size == 3
    with pytest.raises(TopologyError, match=r"lost nodes \['z9'\] are not in cluster 'sites'"):
        topology.without(["z9"])
