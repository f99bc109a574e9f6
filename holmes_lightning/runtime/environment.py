"""`NICGroupingEnvironment`: Lightning's cluster environment plus the Topology (which node and NIC this rank is on)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch.distributed as dist
from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)

from holmes_lightning.topology import ClusterSpec, NICKind, Topology, TopologyError, load_cluster_spec
from holmes_lightning.topology.detect import SYSFS_INFINIBAND, detect_node_nic, reconcile

NODE_ADDRESS_ENV = "HOLMES_NODE_ADDRESS"
FABRIC_ADDRESS_ENV = "HOLMES_FABRIC_ADDRESS"


@dataclass(frozen=True)
class NICReport:
    """What one rank found on its node: the RDMA kind and rate (Ethernet and None when sysfs shows no RDMA port)."""

    rank: int
    node_rank: int
    kind: NICKind
    gbps: float | None


def detect_report(rank: int, node_rank: int, sysfs_root: str | Path = SYSFS_INFINIBAND) -> NICReport:
    kind, gbps = detect_node_nic(sysfs_root)
    return NICReport(rank, node_rank, kind, gbps)


def resolve_nics(spec: ClusterSpec, reports: list[NICReport]) -> ClusterSpec:
    """Fill `nic.kind: null` from detection and warn where a pinned kind disagrees; every rank gets the same answer."""
    topology_nodes = _node_clusters(spec)
    found: dict[str, set[NICKind]] = {}
    for report in reports:
        if report.node_rank >= len(topology_nodes):
            raise TopologyError(
                f"rank {report.rank} runs on node_rank {report.node_rank}, but the cluster config has only "
                f"{len(topology_nodes)} nodes; fix the clusters' `nodes` or the launcher's node count"
            )
        found.setdefault(topology_nodes[report.node_rank], set()).add(report.kind)
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


def _node_clusters(spec: ClusterSpec) -> list[str]:
    return [group.name for group in spec.clusters for _ in range(group.nodes)]


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
    ) -> None:
        self.inner = inner if inner is not None else default_environment()
        self.sysfs_root = sysfs_root
        if isinstance(cluster, Topology):
            self.spec, self._topology = cluster.spec, cluster
        else:
            self.spec = load_cluster_spec(cluster)
            pinned = all(group.nic.kind is not None for group in self.spec.clusters)
            self._topology = Topology(self.spec) if pinned else None

    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise RuntimeError("NIC kinds are detected at start: call exchange() after the process group exists")
        return self._topology

    def exchange(self) -> Topology:
        """All ranks share what they detected (`all_gather_object`) and build the same Topology."""
        mine = detect_report(self.global_rank(), self.node_rank(), self.sysfs_root)
        reports: list[NICReport | None] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, mine)
        self._topology = Topology(resolve_nics(self.spec, reports), self._topology.measured if self._topology else None)
        self.check_placement()
        return self._topology

    def check_placement(self) -> None:
        """The launcher's (world size, node rank, local rank) must be the config's, or groups would mix NICs."""
        topology = self.topology
        topology.check_world_size(self.world_size())
        rank = topology.ranks[self.global_rank()]
        if (rank.node, rank.local_device) != (self.node_rank(), self.local_rank()):
            raise TopologyError(
                f"rank {self.global_rank()} is node {self.node_rank()} / local {self.local_rank()} for the launcher "
                f"but node {rank.node} / local {rank.local_device} in cluster {topology.name!r}; launch nodes in the "
                f"config's order with cluster.devices_per_node processes each"
            )

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
