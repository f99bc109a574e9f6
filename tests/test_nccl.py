"""NCCL's transport decisions, pinned on CPU: the net of each group, and each process's NCCL environment."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from distributed import run_ranks

from holmes_lightning import planner
from holmes_lightning.cli.config import ModelConfig
from holmes_lightning.planner import BatchSettings, ModelProfile, PlanOptions
from holmes_lightning.runtime import nccl
from holmes_lightning.runtime.groups import hop_groups, plan_groups
from holmes_lightning.topology import ClusterSpec, LinkKind, NICKind, Topology, TopologyError, load_cluster_spec

MIXED = {
    "name": "mixed",
    "devices_per_node": 2,
    "clusters": [
        {"name": "ib", "nodes": 2, "nic": {"kind": "infiniband", "hca": ["mlx5_0:1", "mlx5_1:1"]}},
        {"name": "roce", "nodes": 2, "nic": {"kind": "roce", "gid_index": 3, "socket_ifname": "bond0"}},
    ],
}


def mixed_plan(spec: ClusterSpec) -> planner.Plan:
    model = ModelConfig(n_layers=4, d_model=32, n_heads=2, seq_len=16)
    return planner.best_plan(
        Topology(spec), ModelProfile.from_gpt(model), BatchSettings(16, 4), options=PlanOptions(pp=2, dp=4)
    )


def test_inside_a_fabric_nccl_chooses_and_across_fabrics_it_uses_sockets() -> None:
    dp_groups, pp_groups = plan_groups(mixed_plan(load_cluster_spec(MIXED)))
    assert [(g.name, g.link) for g in dp_groups] == [("dp0", LinkKind.RDMA), ("dp1", LinkKind.RDMA)]
    assert [g.name for g in pp_groups] == ["pp0", "pp1", "pp2", "pp3"]
    assert all(g.link is LinkKind.TCP for g in pp_groups)  # every pipeline group joins the IB and the RoCE cluster
    assert [nccl.group_net(g.link, {}) for g in dp_groups] == [None, None]  # not "IB": RoCE nodes need NCCL's pick
    assert {nccl.group_net(g.link, {}) for g in pp_groups} == {"Socket"}
    assert nccl.group_net(LinkKind.INTRA_NODE, {}) is None


def test_pipeline_hops_inside_a_fabric_get_a_group_on_it() -> None:
    # pp=4 over 2 IB + 2 RoCE nodes of 2 GPUs: each DP column's pipeline group spans both kinds (TCP), but only its
    # middle hop crosses; the hops inside the IB and the RoCE cluster get a group of their two ranks on the fabric
    spec = load_cluster_spec(MIXED)
    model = ModelConfig(n_layers=8, d_model=32, n_heads=2, seq_len=16)
    plan = planner.best_plan(
        Topology(spec), ModelProfile.from_gpt(model), BatchSettings(16, 4), options=PlanOptions(pp=4, dp=2)
    )
    layout = plan.mesh_layout()
    hops = hop_groups(plan, Topology(spec))
    assert plan.pp_links == (LinkKind.TCP, LinkKind.TCP)
    assert [(g.name, g.link) for g in hops] == [(f"pp{d}:{a}-{a + 1}", LinkKind.RDMA) for d in range(2) for a in (0, 2)]
    assert [g.ranks for g in hops] == [(layout[a][d], layout[a + 1][d]) for d in range(2) for a in (0, 2)]
    assert {plan.stages[a].nics for a in (0, 1)} != {plan.stages[a].nics for a in (2, 3)}  # one kind on each side
    assert hop_groups(mixed_plan(spec), Topology(spec)) == []  # pp=2: the one hop crosses, as the column does


def test_a_users_nccl_net_rules_every_group() -> None:
    assert nccl.group_net(LinkKind.TCP, {"NCCL_NET": "IB"}) is None
    settings = nccl.process_settings({"NCCL_NET": "IB"}, socket_interface="eth0")
    assert settings.overruled["NCCL_NET"][0] == "IB"
    assert any("NCCL_NET=IB from the environment wins" in note for note in settings.notes())


@pytest.mark.parametrize(
    ("spec", "link"),
    [("single_node", LinkKind.INTRA_NODE), ("ib_only", LinkKind.RDMA), ("two_cluster_mixed", LinkKind.TCP)],
)
def test_the_default_group_uses_sockets_only_when_the_config_spans_fabrics(spec: str, link: LinkKind) -> None:
    assert nccl.world_link(load_cluster_spec(spec)) is link


def test_a_fabric_still_to_be_detected_counts_as_spanning() -> None:
    spec = load_cluster_spec("ib_only")
    detected = replace(spec, clusters=[replace(spec.clusters[0], nic=replace(spec.clusters[0].nic, kind=None))])
    assert nccl.world_link(detected) is LinkKind.TCP


def test_each_node_gets_its_clusters_settings_and_an_exact_interface() -> None:
    spec = load_cluster_spec(MIXED)
    ib_node = nccl.node_settings(spec, node_rank=1, environ={}, detected_interface="eth0")
    sockets = {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}  # TCP groups: 16 sockets per peer
    assert ib_node.values == {"NCCL_SOCKET_IFNAME": "=eth0", "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1", **sockets}
    roce_node = nccl.node_settings(spec, node_rank=2, environ={}, detected_interface="eth0")
    assert roce_node.values == {"NCCL_SOCKET_IFNAME": "=bond0", "NCCL_IB_GID_INDEX": "3", **sockets}  # its interface
    assert nccl.node_settings(spec, node_rank=9, environ={}, detected_interface="eth0").values == {}


def test_variables_the_user_set_win_and_are_named() -> None:
    environ = {"NCCL_SOCKET_IFNAME": "ens1", "NCCL_IB_HCA": "mlx5_4", "NCCL_SOCKET_NTHREADS": "2"}
    settings = nccl.node_settings(load_cluster_spec(MIXED), node_rank=0, environ=environ, detected_interface="eth0")
    assert settings.values == {"NCCL_NSOCKS_PERTHREAD": "4"}
    assert settings.overruled == {
        "NCCL_SOCKET_IFNAME": ("ens1", "=eth0"),
        "NCCL_IB_HCA": ("mlx5_4", "=mlx5_0:1,mlx5_1:1"),
        "NCCL_SOCKET_NTHREADS": ("2", "4"),
    }
    assert "NCCL_IB_HCA=mlx5_4 from the environment wins (ours: =mlx5_0:1,mlx5_1:1)" in settings.notes()


def test_one_node_leaves_the_socket_interface_alone() -> None:
    assert nccl.node_settings(load_cluster_spec("single_node"), 0, {}, detected_interface="eth0").values == {}


def test_the_interface_is_the_one_holding_the_nodes_address() -> None:
    interfaces = {"ib0": ["10.1.0.5"], "eth0": ["192.168.3.5", "fd00::5"], "lo": ["127.0.0.1"]}
    assert nccl.interface_holding("192.168.3.5", interfaces) == "eth0"
    assert nccl.interface_holding("fd00:0::5", interfaces) == "eth0"
    assert nccl.interface_holding("10.9.9.9", interfaces) is None


def test_a_process_detects_and_sets_its_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    """On this machine: the node address 127.0.0.1 is held by the loopback interface."""
    for name in ("NCCL_SOCKET_IFNAME", "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD"):
        monkeypatch.setenv(name, "unset below; restored after the test")
        monkeypatch.delenv(name)
    loopback = nccl.interface_holding("127.0.0.1", nccl.local_interfaces())
    spec = load_cluster_spec("two_cluster_mixed")
    settings = nccl.set_up_process(spec, node_rank=0, node_address="127.0.0.1", rendezvous=("127.0.0.1", 1))
    assert settings.values["NCCL_SOCKET_IFNAME"] == f"={loopback}"
    assert os.environ["NCCL_SOCKET_IFNAME"] == f"={loopback}"


@pytest.mark.parametrize(
    ("nic", "message"),
    [
        ({"kind": "roce", "hca": ["mlx5_0:1", "bad name"]}, r"nic.hca=\['mlx5_0:1', 'bad name'\]: list RDMA devices"),
        ({"kind": "roce", "hca": []}, r"nic.hca=\[\]"),
        ({"kind": "infiniband", "gid_index": 3}, r"nic.gid_index=3: .* InfiniBand has none"),
        ({"kind": "roce", "gid_index": -1}, r"nic.gid_index=-1: a RoCE GID index is >= 0"),
        ({"kind": "roce", "socket_ifname": "eth0,eth1"}, r"nic.socket_ifname='eth0,eth1': name one network interface"),
    ],
)
def test_bad_nccl_settings_in_a_cluster_config_are_refused(nic: dict, message: str) -> None:
    config = {"name": "x", "clusters": [{"name": "a", "nodes": 2, "nic": nic}]}
    with pytest.raises(TopologyError, match=rf"cluster.clusters\[0\]\.{message}"):
        Topology.from_config(config)


def test_nccl_settings_survive_the_config_schema() -> None:
    nic = load_cluster_spec(MIXED).clusters[1].nic
    assert (nic.kind, nic.gid_index, nic.socket_ifname, nic.hca) == (NICKind.roce, 3, "bond0", None)


def probe_with_a_silent_member() -> str:
    """Rank side: a group of both ranks whose rank 1 never joins the probe (it waits on the default group until rank
    0 has its error); rank 0's error, and how long it took."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from holmes_lightning.runtime.groups import GroupSpec, Transport, connected_group, new_group

    spec, transport, job_timeout = GroupSpec("dp7", (0, 1), LinkKind.TCP), Transport(LinkKind.TCP, None), 30
    dist.init_process_group("gloo", timeout=timedelta(seconds=job_timeout))
    if dist.get_rank() == 1:
        new_group(spec.ranks, "gloo", transport, timedelta(seconds=job_timeout), name=spec.name)
        dist.barrier()
        return ""
    start = time.monotonic()
    try:
        probe = timedelta(seconds=2)
        connected_group(spec, "gloo", transport, timedelta(seconds=job_timeout), torch.device("cpu"), probe)
        outcome = "connected"
    except RuntimeError as error:
        outcome = f"{time.monotonic() - start:.1f} {error}"
    dist.barrier()
    return outcome


@pytest.mark.slow
def test_a_group_that_cannot_connect_fails_at_start_by_name_not_after_the_jobs_timeout() -> None:
    # the job's timeout (30 s) also ends any wait of the ranks' own; the deadline only guards against a hang
    first, _ = run_ranks("test_nccl:probe_with_a_silent_member", cluster="single_node", timeout_s=120)
    seconds, message = first.split(" ", 1)
    assert 2 <= float(seconds) < 10  # the probe's 2 s, not the job's 30
    assert message.startswith("process group dp7 (ranks [0, 1], tcp link, gloo) could not be set up")
