"""What the hardware is: clusters, nodes, NIC kinds and link speeds."""

from holmes_lightning.topology.detect import detect_node_nic, detect_ports
from holmes_lightning.topology.spec import (
    ClusterGroupSpec,
    ClusterPairSpec,
    ClusterSpec,
    ConfigEnum,
    InterClusterSpec,
    LinkSpec,
    NICKind,
    NICSpec,
)
from holmes_lightning.topology.topology import (
    Link,
    LinkClass,
    LinkKind,
    LinkScope,
    NICGroup,
    Node,
    RankInfo,
    Topology,
    TopologyError,
    config_dir,
    load_cluster_spec,
    shipped_cluster_names,
)

__all__ = [
    "ClusterGroupSpec",
    "ClusterPairSpec",
    "ClusterSpec",
    "ConfigEnum",
    "InterClusterSpec",
    "Link",
    "LinkClass",
    "LinkKind",
    "LinkScope",
    "LinkSpec",
    "NICGroup",
    "NICKind",
    "NICSpec",
    "Node",
    "RankInfo",
    "Topology",
    "TopologyError",
    "config_dir",
    "detect_node_nic",
    "detect_ports",
    "load_cluster_spec",
    "shipped_cluster_names",
]
