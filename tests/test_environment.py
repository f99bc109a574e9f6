"""Launcher environments -> where each rank sits in the cluster config, and which device it drives (pure functions)."""

import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

from holmes_lightning import HolmesStrategy
from holmes_lightning.launch.processes import rank_env
from holmes_lightning.runtime.environment import NICGroupingEnvironment, default_environment, resolve_nics
from holmes_lightning.runtime.placement import (
    RankReport,
    attend,
    choose_device,
    host_position,
    launch_mismatch,
    node_layout,
)
from holmes_lightning.topology import NICKind, Topology, TopologyError, load_cluster_spec

TORCHRUN = {
    "RANK": "3",
    "LOCAL_RANK": "0",
    "GROUP_RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "10.1.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "job",
}
SLURM = {
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_ID": "77",
    "SLURM_NODELIST": "a-[01-02],b-[01-02]",
    "SLURM_NTASKS_PER_NODE": "1",
}
MIXED = Topology.from_config("two_cluster_mixed")
CUDA = [torch.device("cuda", i) for i in range(8)]


@pytest.fixture
def clean_env(monkeypatch):
    for key in [*TORCHRUN, *SLURM, "NODE_RANK", "SLURM_NNODES", "HOLMES_LAUNCHED", "HOLMES_TOPOLOGY"]:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def reports(numbering: list[tuple[int, int]], hosts: list[str] | None = None) -> list[RankReport]:
    """What each rank reports for a launcher's (node rank, local rank) per rank, on the given host per node."""
    return [
        RankReport(rank, node, local, ((hosts[node] if hosts else "one-host"),), NICKind.ethernet)
        for rank, (node, local) in enumerate(numbering)
    ]


def multi_node(topology: Topology) -> list[tuple[int, int]]:
    """torchrun / SLURM / holmes-launch: node by node, local ranks from 0 on each."""
    return [(info.node, info.local_device) for info in topology.ranks]


def one_node(topology: Topology) -> list[tuple[int, int]]:
    """Lightning's launcher with devices=N, `torchrun --standalone --nproc-per-node N`: all on node 0."""
    return [(0, rank) for rank in range(topology.world_size)]


def test_torchrun_variables(clean_env):
    for key, value in TORCHRUN.items():
        clean_env.setenv(key, value)
    env = NICGroupingEnvironment("two_cluster_mixed")
    assert isinstance(env.inner, TorchElasticEnvironment)
    assert (env.global_rank(), env.world_size(), env.node_rank(), env.local_rank()) == (3, 4, 3, 0)
    assert env.main_address == "10.1.0.1" and env.main_port == 29500
    env.check_launch(trainer=None)
    assert env.topology.ranks[env.global_rank()].nic is NICKind.roce


def test_slurm_variables(clean_env):
    for key, value in SLURM.items():
        clean_env.setenv(key, value)
    env = NICGroupingEnvironment("two_cluster_mixed")
    assert isinstance(env.inner, SLURMEnvironment)
    assert (env.global_rank(), env.world_size(), env.node_rank()) == (2, 4, 2)
    env.check_launch(trainer=None)
    assert env.topology.ranks[2].cluster == "B"


def test_plain_machine_uses_lightning_environment(clean_env):
    assert isinstance(default_environment(), LightningEnvironment)


def emulated(layout: Topology, found: list[RankReport], min_nodes: int | None = None) -> bool:
    """`attend` for a launch of every node of `layout`: whether one host plays them (the layout is the config's)."""
    attendance = attend(layout, found, min_nodes)
    assert attendance.layout is layout and attendance.missing == ()
    return attendance.emulated


def test_multi_node_numbering_is_checked_strictly():
    layout = node_layout(MIXED.spec)
    assert emulated(layout, reports(multi_node(MIXED))) is False
    numbering = multi_node(MIXED)
    numbering[3] = (2, 1)
    with pytest.raises(TopologyError, match="launcher node 2 \\('one-host'\\) runs 2 processes but plays node"):
        attend(layout, reports(numbering))


def test_one_host_plays_every_node():
    """Lightning's launcher and torchrun --standalone number everything on node 0: emulated, not an error."""
    assert emulated(node_layout(MIXED.spec), reports(one_node(MIXED))) is True


def test_size_mismatch_keeps_its_error():
    with pytest.raises(
        TopologyError, match="world size 3 from the launcher does not match cluster 'two_cluster_mixed'"
    ) as err:
        attend(node_layout(MIXED.spec), reports(one_node(MIXED))[:3])
    assert "elastic.min_nodes=N" in str(err.value)


def test_launch_mismatch_says_what_to_pass():
    layout = node_layout(MIXED.spec)
    assert launch_mismatch(layout, 4, trainer=(4, 1)) is None
    message = launch_mismatch(layout, 1, trainer=(1, 1))
    assert "Trainer(devices=1, num_nodes=1) starts 1; pass Trainer(devices=4)" in message
    assert "holmes-launch cluster=two_cluster_mixed" in message and "--nproc-per-node 4" in message
    assert "launch 4 processes" in launch_mismatch(layout, 8)
    assert launch_mismatch(layout, 2, min_nodes=1) is None  # fewer may join: decided once they have
    assert "launch 4 processes" in launch_mismatch(layout, 8, min_nodes=1)


def test_trainer_with_auto_devices_fails_before_spawning(clean_env):
    """`devices="auto"` on this 1-device CPU would start 1 process for a 4-rank cluster: an error at Trainer()."""
    strategy = HolmesStrategy(cluster="two_cluster_mixed", global_batch=8)
    with pytest.raises(TopologyError, match=r"pass Trainer\(devices=4\) to run every node on this machine"):
        L.Trainer(accelerator="cpu", devices="auto", strategy=strategy, logger=False)


HOSTS = ["a-01", "a-02", "b-01", "b-02"]


def named_cluster() -> Topology:
    spec = load_cluster_spec("two_cluster_mixed")
    spec.clusters[0].hostnames, spec.clusters[1].hostnames = HOSTS[:2], HOSTS[2:]
    return Topology(spec)


def numbered(hosts: list[str], devices: dict[str, int] | None = None) -> list[RankReport]:
    """torchrun's numbering of nodes on `hosts` (in its order), node by node, one rank per device."""
    found, rank = [], 0
    for node, host in enumerate(hosts):
        for local in range((devices or {}).get(host, 1)):
            found.append(RankReport(rank, node, local, (host,), NICKind.ethernet))
            rank += 1
    return found


def test_hosts_in_another_order_play_the_nodes_they_are_named_as():
    """torchrun's c10d sorts nodes by address, not by the config: each cluster's nodes together is enough."""
    attendance = attend(node_layout(named_cluster().spec), numbered(["b-02", "b-01", "a-01", "a-02"]))
    assert [node.name for node in attendance.layout.nodes] == ["b-02", "b-01", "a-01", "a-02"]
    assert [group.name for group in attendance.layout.spec.clusters] == ["B", "A"]
    assert attendance.missing == () and attendance.emulated is False


def test_hosts_that_mix_clusters_or_are_not_named_are_refused():
    layout = node_layout(named_cluster().spec)
    with pytest.raises(TopologyError, match="the launcher's node order mixes clusters") as err:
        attend(layout, numbered(["b-01", "a-02", "a-01", "b-02"]))
    assert "--local-addr" in str(err.value) and "--node-rank" in str(err.value)
    with pytest.raises(TopologyError, match="launcher node 2 runs on 'c-07', a host cluster 'two_cluster_mixed'"):
        attend(layout, numbered(["a-01", "a-02", "c-07", "b-02"]))


def test_hostnames_match_by_address_or_short_name():
    topology = named_cluster()
    numbering = multi_node(topology)
    hosts = [("a-01.cluster", "a-01", "10.0.0.1"), ("x", "a-02"), ("b-01",), ("10.0.1.2", "b-02")]
    found = [RankReport(r, n, lo, hosts[n], NICKind.ethernet) for r, (n, lo) in enumerate(numbering)]
    assert emulated(node_layout(topology.spec), found) is False


def test_holmes_launch_on_one_host_skips_the_hostname_check():
    topology = named_cluster()
    assert emulated(node_layout(topology.spec), reports(multi_node(topology), ["vm"] * 4)) is False


def test_fewer_nodes_join_only_with_min_nodes_and_plan_as_the_nodes_present():
    layout = node_layout(named_cluster().spec)
    three = numbered(["a-01", "b-01", "b-02"])
    with pytest.raises(TopologyError, match="elastic.min_nodes=N"):
        attend(layout, three)
    attendance = attend(layout, three, min_nodes=3)
    assert attendance.missing == ("a-02",)
    assert [(node.name, node.cluster) for node in attendance.layout.nodes] == [
        ("a-01", "A"),
        ("b-01", "B"),
        ("b-02", "B"),
    ]
    assert "3 of the 4 nodes of cluster 'two_cluster_mixed' joined; missing: a-02" in attendance.describe(layout)
    with pytest.raises(TopologyError, match="3 of the 4 nodes .* joined \\(missing: a-02\\), fewer than min_nodes=4"):
        attend(layout, three, min_nodes=4)
    whole_cluster_gone = attend(layout, numbered(["b-01", "b-02"]), min_nodes=1)
    assert [group.name for group in whole_cluster_gone.layout.spec.clusters] == ["B"]


def test_without_hostnames_fewer_nodes_are_the_config_s_first():
    layout = node_layout(MIXED.spec)
    attendance = attend(layout, reports(multi_node(MIXED))[:3], min_nodes=2)
    assert attendance.missing == ("B-node1",) and len(attendance.layout.nodes) == 3
    one_host = attend(layout, reports(one_node(MIXED))[:2], min_nodes=1)
    assert one_host.emulated is True and one_host.missing == ("B-node0", "B-node1")


cluster_groups = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3)), min_size=1, max_size=4)


def random_named_layout(groups: list[tuple[int, int]]) -> tuple[Topology, list[str]]:
    clusters, hosts = [], []
    for i, (nodes, devices) in enumerate(groups):
        names = [f"h{len(hosts) + j}" for j in range(nodes)]
        hosts += names
        clusters.append({"name": f"C{i}", "nodes": nodes, "devices_per_node": devices, "hostnames": names})
    return node_layout(load_cluster_spec({"name": "random", "clusters": clusters})), hosts


@settings(max_examples=60, deadline=None)
@given(groups=cluster_groups, data=st.data())
def test_random_topologies_place_every_launch(groups, data):
    """Any config: node-by-node numbering is strict, one-node numbering is emulated; hosts in another order play
    their named nodes when each cluster's stay together, and are refused otherwise."""
    layout, hosts = random_named_layout(groups)
    assert emulated(layout, reports(multi_node(layout), hosts)) is False
    assert emulated(layout, reports(one_node(layout))) is (len(hosts) > 1)
    order = data.draw(st.permutations(hosts))
    devices = {node.name: len(node.ranks) for node in layout.nodes}
    clusters = [layout.node_of(layout.nodes[hosts.index(h)].ranks[0]).cluster for h in order]
    together = all(c not in clusters[:i] or clusters[i - 1] == c for i, c in enumerate(clusters))
    if together:
        attendance = attend(layout, numbered(order, devices))
        assert [node.name for node in attendance.layout.nodes] == order
    else:
        with pytest.raises(TopologyError, match="the launcher's node order mixes clusters"):
            attend(layout, numbered(order, devices))


@settings(max_examples=60, deadline=None)
@given(groups=cluster_groups, data=st.data())
def test_random_subsets_of_named_nodes_plan_as_present_or_are_refused(groups, data):
    """Any config less any nodes, in the config's order: the nodes present, or a clear refusal below min_nodes."""
    layout, hosts = random_named_layout(groups)
    present = [h for h in hosts if data.draw(st.booleans(), label=h)]
    least = data.draw(st.integers(1, len(hosts)), label="min_nodes")
    devices = {node.name: len(node.ranks) for node in layout.nodes}
    if not present:
        return
    if len(present) < least:
        with pytest.raises(TopologyError, match=f"fewer than min_nodes={least}"):
            attend(layout, numbered(present, devices), least)
        return
    attendance = attend(layout, numbered(present, devices), least)
    assert [node.name for node in attendance.layout.nodes] == present
    assert set(attendance.missing) == set(hosts) - set(present)
    assert attendance.layout.world_size == sum(devices[h] for h in present)


@pytest.mark.parametrize(
    ("environ", "local_rank", "devices", "expected"),
    [
        ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}, 2, 4, (2, 4)),  # torchrun --standalone
        ({"LOCAL_RANK": "1", "NODE_RANK": "0"}, 1, 4, (1, 4)),  # Lightning's launcher, devices=4
        ({"RANK": "3", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "HOLMES_LAUNCHED": "1"}, 0, 1, (3, 4)),  # holmes-launch
    ],
)
def test_host_position(environ, local_rank, devices, expected):
    assert host_position(environ, local_rank, devices) == expected


def test_holmes_launch_ranks_get_distinct_gpus():
    """Our launcher says LOCAL_RANK=0 on every emulated node; on one real host they must not all use cuda:0."""
    topology = Topology.from_config("two_cluster_mixed", devices_per_node=2)
    devices = []
    for rank in range(topology.world_size):
        environ = rank_env(topology, rank, "127.0.0.1", 29500)
        host_rank, host_ranks = host_position(environ, int(environ["LOCAL_RANK"]), 2)
        devices.append(choose_device(CUDA[:2], visible=8, host_rank=host_rank, host_ranks=host_ranks, backend="nccl"))
    assert devices == CUDA


def test_device_choice():
    assert choose_device(CUDA[:4], visible=4, host_rank=3, host_ranks=4, backend="nccl") == CUDA[3]
    assert choose_device(CUDA[2:4], visible=4, host_rank=1, host_ranks=2, backend="nccl") == CUDA[3]  # devices=[2, 3]
    assert choose_device([torch.device("cpu")], visible=1, host_rank=3, host_ranks=4, backend="gloo").type == "cpu"
    assert choose_device(CUDA[:1], visible=2, host_rank=3, host_ranks=4, backend="gloo") == CUDA[1]  # gloo may share


def test_two_nccl_ranks_never_share_a_gpu():
    with pytest.raises(TopologyError, match="4 ranks run on this host but it has 2 cuda device.*NCCL cannot put two"):
        choose_device(CUDA[:1], visible=2, host_rank=0, host_ranks=4, backend="nccl")


def unpinned():
    spec = load_cluster_spec("two_cluster_mixed")
    for group in spec.clusters:
        group.nic.kind = None
    return spec


def nic_reports(kinds: list[NICKind], gbps: float | None = None) -> list[RankReport]:
    return [RankReport(r, r, 0, ("h",), kind, gbps) for r, kind in enumerate(kinds)]


def test_detection_fills_unpinned_kinds():
    found = nic_reports([NICKind.infiniband] * 2 + [NICKind.roce] * 2, 200)
    resolved = resolve_nics(unpinned(), found)
    assert [g.nic.kind for g in resolved.clusters] == ["infiniband", "roce"]


def test_detection_on_one_host_uses_the_config_rank():
    """Emulated on one host, every rank says node 0; its cluster is still its config rank's."""
    found = [RankReport(r, 0, r, ("h",), kind) for r, kind in enumerate([NICKind.infiniband] * 2 + [NICKind.roce] * 2)]
    assert [g.nic.kind for g in resolve_nics(unpinned(), found).clusters] == ["infiniband", "roce"]


def test_detection_disagreeing_inside_a_cluster_is_an_error():
    with pytest.raises(TopologyError, match="cluster 'A': its nodes report different NICs"):
        resolve_nics(unpinned(), nic_reports([NICKind.infiniband, NICKind.roce]))


def test_pinned_kind_against_detection_warns():
    with pytest.warns(UserWarning, match="cluster 'A'"):
        resolved = resolve_nics(load_cluster_spec("two_cluster_mixed"), nic_reports([NICKind.roce] * 4, 100))
    assert resolved.clusters[0].nic.kind == "infiniband"


def test_no_rdma_seen_keeps_pinned_kinds_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolved = resolve_nics(load_cluster_spec("two_cluster_mixed"), nic_reports([NICKind.ethernet] * 4))
    assert [g.nic.kind for g in resolved.clusters] == ["infiniband", "roce"]


def test_exchange_builds_the_topology_over_a_real_process_group(clean_env, tmp_path):
    make_sysfs = tmp_path / "mlx5_0" / "ports" / "1"
    make_sysfs.mkdir(parents=True)
    (make_sysfs / "link_layer").write_text("InfiniBand\n")
    (make_sysfs / "rate").write_text("400 Gb/sec (4X NDR)\n")
    spec = load_cluster_spec({"name": "one", "clusters": [{"name": "A", "nodes": 1, "nic": {"kind": None}}]})
    env = NICGroupingEnvironment(spec, sysfs_root=tmp_path)
    with pytest.raises(RuntimeError, match="exchange"):
        _ = env.topology
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        topology = env.exchange()
    finally:
        dist.destroy_process_group()
    assert topology.nodes[0].nic is NICKind.infiniband
    assert env.emulated is False
