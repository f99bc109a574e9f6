"""Structured cluster configs: the schema of `conf/cluster/*.yaml` (a misspelled key or a wrong type is an error)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class ConfigEnum(str, Enum):
    """A string-valued choice: Hydra matches config values to member names, so members are named as their values.

    `str()` and f-strings give the value (as `str` subclasses do on every Python version), JSON writes the value.
    """

    def __str__(self) -> str:
        return self.value


class NICKind(ConfigEnum):
    """The fabric a node's network card speaks."""

    infiniband = "infiniband"
    roce = "roce"
    ethernet = "ethernet"

    @property
    def is_rdma(self) -> bool:
        return self is not NICKind.ethernet


@dataclass
class NICSpec:
    """A node's NIC: its kind (None = detect from sysfs, Ethernet if none found) and per-port bandwidth.

    NCCL settings for the cluster's nodes, each None for NCCL's own choice: `hca`, the RDMA devices (and ports) to
    use (NCCL_IB_HCA, e.g. [mlx5_0:1, mlx5_1:1]); `gid_index`, RoCE's GID index (NCCL_IB_GID_INDEX, often 3 for RoCE
    v2); `socket_ifname`, the Ethernet interface that reaches the other clusters (NCCL_SOCKET_IFNAME; default: the
    one holding the node's address).
    """

    kind: NICKind | None = NICKind.ethernet
    gbps: float = 100.0
    hca: list[str] | None = None
    gid_index: int | None = None
    socket_ifname: str | None = None


@dataclass
class LinkSpec:
    """A link that is not a node's own fabric: intra-node (NVLink/PCIe) or between clusters (Ethernet/TCP)."""

    gbps: float = 100.0


@dataclass
class ClusterPairSpec:
    """The link between two named clusters where it differs from `inter_cluster.gbps` (e.g. two sites)."""

    clusters: list[str] = field(default_factory=list)
    gbps: float = 100.0


@dataclass
class InterClusterSpec:
    """The Ethernet/TCP links between clusters: `gbps` for every pair, `pairs` overriding it pair by pair.

    `inter_cluster: {gbps: 10, pairs: [{clusters: [A, B], gbps: 100}, {clusters: [B, C], gbps: 25}]}`: A-B at
    100 Gb/s, B-C at 25, every other pair (A-C) at 10. A communicator forced onto TCP inside one cluster uses `gbps`.
    """

    gbps: float = 100.0
    pairs: list[ClusterPairSpec] = field(default_factory=list)

    def scaled(self, factor: float) -> InterClusterSpec:
        """Every speed times `factor`."""
        pairs = [ClusterPairSpec(list(pair.clusters), pair.gbps * factor) for pair in self.pairs]
        return InterClusterSpec(self.gbps * factor, pairs)


@dataclass
class TransportEfficiencySpec:
    """The share of a configured line rate each transport delivers to NCCL's collectives and messages, for links no
    probe measured (a measured speed is what was delivered, and replaces it).

    `rdma`: InfiniBand and RoCE reach about 90% of line rate (nccl-tests bus bandwidth, e.g. ~24 GB/s on 200 Gb/s
    HDR/NDR200 ports). `tcp`: NCCL over TCP sockets reaches 32-48 Gb/s on 100 GbE (nccl-tests with
    NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD tuned), hence 0.4. `intra_node`: NVLink/PCIe as configured (give
    `intra_node.gbps` as nccl-tests measures it).
    """

    intra_node: float = 1.0
    rdma: float = 0.9
    tcp: float = 0.4


@dataclass
class ClusterGroupSpec:
    """One cluster: nodes of one NIC kind. `devices_per_node` / `device_tflops` default to the top-level values."""

    name: str = "???"
    nodes: int = 1
    nic: NICSpec = field(default_factory=NICSpec)
    devices_per_node: int | None = None
    device_tflops: float | None = None
    hostnames: list[str] | None = None


@dataclass
class ClusterSpec:
    """A whole job's hardware: clusters, their NICs, and the links between and inside nodes."""

    name: str = "cluster"
    clusters: list[ClusterGroupSpec] = field(default_factory=list)
    devices_per_node: int = 1
    device_tflops: float = 312.0
    intra_node: LinkSpec = field(default_factory=lambda: LinkSpec(gbps=2400.0))
    inter_cluster: InterClusterSpec = field(default_factory=InterClusterSpec)
    transport_efficiency: TransportEfficiencySpec = field(default_factory=TransportEfficiencySpec)
    measured: str | None = None
