import warnings

import pytest
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

from holmes_lightning.runtime.environment import (
    NICGroupingEnvironment,
    NICReport,
    default_environment,
    resolve_nics,
)
from holmes_lightning.topology import NICKind, TopologyError, load_cluster_spec

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


@pytest.fixture
def clean_env(monkeypatch):
    for key in [*TORCHRUN, *SLURM, "NODE_RANK", "SLURM_NNODES"]:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_torchrun_variables(clean_env):
    for key, value in TORCHRUN.items():
        clean_env.setenv(key, value)
    env = NICGroupingEnvironment("two_cluster_mixed")
    assert isinstance(env.inner, TorchElasticEnvironment)
    assert (env.global_rank(), env.world_size(), env.node_rank(), env.local_rank()) == (3, 4, 3, 0)
    assert env.main_address == "10.1.0.1" and env.main_port == 29500
    env.check_placement()
    assert env.topology.ranks[env.global_rank()].nic is NICKind.roce


def test_slurm_variables(clean_env):
    for key, value in SLURM.items():
        clean_env.setenv(key, value)
    env = NICGroupingEnvironment("two_cluster_mixed")
    assert isinstance(env.inner, SLURMEnvironment)
    assert (env.global_rank(), env.world_size(), env.node_rank()) == (2, 4, 2)
    env.check_placement()
    assert env.topology.ranks[2].cluster == "B"


def test_plain_machine_uses_lightning_environment(clean_env):
    assert isinstance(default_environment(), LightningEnvironment)


def test_launcher_disagreeing_with_config_is_an_error(clean_env):
    for key, value in {**TORCHRUN, "WORLD_SIZE": "8"}.items():
        clean_env.setenv(key, value)
    with pytest.raises(TopologyError, match="world size 8"):
        NICGroupingEnvironment("two_cluster_mixed").check_placement()
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("GROUP_RANK", "1")
    with pytest.raises(TopologyError, match="rank 3 is node 1"):
        NICGroupingEnvironment("two_cluster_mixed").check_placement()


def unpinned():
    spec = load_cluster_spec("two_cluster_mixed")
    for group in spec.clusters:
        group.nic.kind = None
    return spec


def test_detection_fills_unpinned_kinds():
    reports = [NICReport(0, 0, NICKind.infiniband, 200), NICReport(1, 1, NICKind.infiniband, 200)]
    reports += [NICReport(2, 2, NICKind.roce, 100), NICReport(3, 3, NICKind.roce, 100)]
    resolved = resolve_nics(unpinned(), reports)
    assert [g.nic.kind for g in resolved.clusters] == ["infiniband", "roce"]


def test_detection_disagreeing_inside_a_cluster_is_an_error():
    reports = [NICReport(0, 0, NICKind.infiniband, 200), NICReport(1, 1, NICKind.roce, 200)]
    with pytest.raises(TopologyError, match="cluster 'A': its nodes report different NICs"):
        resolve_nics(unpinned(), reports)


def test_pinned_kind_against_detection_warns():
    reports = [NICReport(r, r, NICKind.roce, 100) for r in range(4)]
    with pytest.warns(UserWarning, match="cluster 'A'"):
        resolved = resolve_nics(load_cluster_spec("two_cluster_mixed"), reports)
    assert resolved.clusters[0].nic.kind == "infiniband"


def test_no_rdma_seen_keeps_pinned_kinds_silently():
    reports = [NICReport(r, r, NICKind.ethernet, None) for r in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolved = resolve_nics(load_cluster_spec("two_cluster_mixed"), reports)
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
