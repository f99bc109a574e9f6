from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from holmes_lightning.topology import (
    ClusterGroupSpec,
    ClusterSpec,
    LinkKind,
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
    assert topology.link(0, 1).kind is LinkKind.RDMA and topology.link(0, 1).gbps == 200
    assert topology.link(1, 2).kind is LinkKind.TCP and topology.link(1, 2).gbps == 100
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
    assert speeds == {400}


def test_measured_bandwidths_replace_configured(tmp_path: Path):
    measured = tmp_path / "probe.json"
    measured.write_text('{"links": {"rdma:A": 180.5, "inter_cluster": 42}}')
    topology = Topology.from_config("two_cluster_mixed", measured=str(measured))
    assert topology.link(0, 1).gbps == 180.5 and topology.link(0, 2).gbps == 42
    assert topology.link(2, 3).gbps == 200


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
