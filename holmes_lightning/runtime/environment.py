"""`NICGroupingEnvironment`: Lightning's cluster environment plus the Topology (which node and NIC this rank is on)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist
from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from holmes_lightning.launch.processes import launched_topology
from holmes_lightning.runtime.placement import (
    NODE_ADDRESS_ENV,
    RankReport,
    attend,
    host_identity,
    launch_mismatch,
    node_layout,
)
from holmes_lightning.topology import ClusterSpec, NICKind, Topology, TopologyError, load_cluster_spec
from holmes_lightning.topology.detect import SYSFS_INFINIBAND, detect_node_nic, reconcile

FABRIC_ADDRESS_ENV = "HOLMES_FABRIC_ADDRESS"


def detect_report(rank: int, node_rank: int, local_rank: int, sysfs_root: str | Path = SYSFS_INFINIBAND) -> RankReport:
    """This rank's launcher numbering, its host's names and its node's NIC as sysfs shows it."""
    kind, gbps = detect_node_nic(sysfs_root)
    return RankReport(rank, node_rank, local_rank, host_identity(os.environ), kind, gbps)


def resolve_nics(spec: ClusterSpec, reports: list[RankReport]) -> ClusterSpec:
    """Fill `nic.kind: null` from detection and warn where a pinned kind disagrees; every rank gets the same answer.

    Rank r reports for the config's rank r (see `placement`), so its node's cluster is the config's.
    """
    layout = node_layout(spec)
    found: dict[str, set[NICKind]] = {}
    for report in reports:
        found.setdefault(layout.node_of(report.rank).cluster, set()).add(report.kind)
    clusters = []
    for group in spec.clusters:
        kinds = found.get(group.name, set())
        if len(kinds) > 1:
            raise TopologyError(
                f"cluster {group.name!r}: its nodes report different NICs {sorted(k.value for k in kinds)}; split it "
                f"into one cluster per NIC kind in the config"
            )
        detected = next(iter(kinds), NICKind.ethernet)
        if group.nic.kind is None:
            kind = detected
        elif detected is NICKind.ethernet:  # no RDMA device seen: nothing to contradict a pinned kind
            kind = NICKind(group.nic.kind)
        else:
            kind = reconcile(group.nic.kind, detected, f"cluster {group.name!r}")
        clusters.append(replace(group, nic=replace(group.nic, kind=kind)))
    return replace(spec, clusters=clusters)


def cluster_source(
    given: str | Path | dict | ClusterSpec | Topology | None, *, nodes: int, processes_per_node: int
) -> str | Path | dict | ClusterSpec | Topology:
    """The cluster a strategy runs: holmes-launch's (command-line overrides win over the script's `given`), else
    `given`, else the launched nodes with their NIC kinds detected."""
    launched = launched_topology()
    if launched is not None:
        spec = given.spec if isinstance(given, Topology) else given
        if spec is not None and load_cluster_spec(spec) != launched.spec:
            rank_zero_info(
                f"HolmesStrategy: running the cluster holmes-launch started ({launched.name!r}, "
                f"{launched.world_size} ranks, command-line overrides included) instead of cluster={given!r}"
            )
        return launched
    if given is not None:
        return given
    clusters = [{"name": "local", "nodes": nodes, "nic": {"kind": None}}]
    return {"name": "launched", "devices_per_node": processes_per_node, "clusters": clusters}


def default_environment() -> ClusterEnvironment:
    """The environment Lightning itself would pick: torchelastic, then SLURM, then Lightning's own launcher."""
    if TorchElasticEnvironment.detect():
        return TorchElasticEnvironment()
    if SLURMEnvironment.detect():
        return SLURMEnvironment()
    return LightningEnvironment()


class NICGroupingEnvironment(ClusterEnvironment):
    """Delegates ranks, addresses and ports to the launcher's environment and adds the job's Topology."""

    def __init__(
        self,
        cluster: str | Path | dict | ClusterSpec | Topology,
        inner: ClusterEnvironment | None = None,
        sysfs_root: str | Path = SYSFS_INFINIBAND,
        min_nodes: int | None = None,
    ) -> None:
        self.inner = inner if inner is not None else default_environment()
        self.sysfs_root = sysfs_root
        self.min_nodes = min_nodes
        if isinstance(cluster, Topology):
            self.spec, self._topology = cluster.spec, cluster
        else:
            self.spec = load_cluster_spec(cluster)
            pinned = all(group.nic.kind is not None for group in self.spec.clusters)
            self._topology = Topology(self.spec) if pinned else None
        self.layout = node_layout(self.spec)
        self.emulated = False

    @property
    def configured(self) -> Topology | None:
        """The config's Topology where it pins every NIC kind (None: they are detected once the processes start)."""
        return self._topology

    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise RuntimeError("NIC kinds are detected at start: call exchange() after the process group exists")
        return self._topology

    def check_launch(self, trainer: tuple[int, int] | None) -> None:
        """The launch's size must be the config's (or smaller, with `min_nodes`), checked before any process starts or
        joins.

        `trainer`: (devices, num_nodes) when Lightning's launcher starts the processes from the Trainer's flags.
        """
        message = launch_mismatch(self.layout, self.world_size(), trainer, self.min_nodes)
        if message is not None:
            raise TopologyError(message)

    def exchange(self) -> Topology:
        """All ranks share where they run and what they detected (`all_gather_object`) and build the same Topology:
        the config's nodes that joined (`placement.attend`; the missing ones are logged).

        Sets `emulated`: one host plays every node of the config (Lightning's launcher, `torchrun --standalone`).
        """
        mine = detect_report(self.global_rank(), self.node_rank(), self.local_rank(), self.sysfs_root)
        reports: list[RankReport | None] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, mine)
        attendance = attend(self.layout, reports, self.min_nodes)
        if attendance.missing:
            rank_zero_info(attendance.describe(self.layout))
        if attendance.layout is not self.layout:  # fewer nodes, or another order: the config's NICs, still to detect
            nics = {group.name: group.nic for group in self.spec.clusters}
            present = attendance.layout.spec
            self.spec = replace(present, clusters=[replace(g, nic=nics[g.name]) for g in present.clusters])
        self.layout, self.emulated = attendance.layout, attendance.emulated
        self._topology = Topology(resolve_nics(self.spec, reports), self._topology.measured if self._topology else None)
        return self._topology

    @property
    def node_address(self) -> str | None:
        """This node's Ethernet/TCP address (set by the lab, or by hand on multi-homed hosts); None: the default."""
        return os.environ.get(NODE_ADDRESS_ENV)

    @property
    def fabric_address(self) -> str | None:
        """This node's address on its RDMA fabric, for groups inside one fabric; None: same as `node_address`."""
        return os.environ.get(FABRIC_ADDRESS_ENV) or self.node_address

    @property
    def creates_processes_externally(self) -> bool:
        return self.inner.creates_processes_externally

    @property
    def main_address(self) -> str:
        return self.inner.main_address

    @property
    def main_port(self) -> int:
        return self.inner.main_port

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return self.inner.world_size()

    def set_world_size(self, size: int) -> None:
        self.inner.set_world_size(size)

    def global_rank(self) -> int:
        return self.inner.global_rank()

    def set_global_rank(self, rank: int) -> None:
        self.inner.set_global_rank(rank)

    def local_rank(self) -> int:
        return self.inner.local_rank()

    def node_rank(self) -> int:
        return self.inner.node_rank()

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        self.inner.validate_settings(num_devices, num_nodes)

    def teardown(self) -> None:
        self.inner.teardown()
