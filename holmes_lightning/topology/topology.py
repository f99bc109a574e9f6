"""`Topology`: which rank sits on which node, cluster and NIC, and how fast any two ranks can talk."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from holmes_lightning.topology.spec import ClusterGroupSpec, ClusterSpec, InterClusterSpec, NICKind, NICSpec

NCCL_DEVICE = re.compile(r"[A-Za-z0-9_.@-]+(:\d+)?")  # an RDMA device[:port] or a network interface


class TopologyError(ValueError):
    """A cluster config that cannot describe real hardware; the message names the field and the fix."""


class LinkKind(str, Enum):
    """How two ranks reach each other."""

    INTRA_NODE = "intra_node"
    RDMA = "rdma"
    TCP = "tcp"


class LinkScope(str, Enum):
    """Which part of the configuration sets a link's speed."""

    intra_node = "intra_node"  # NVLink/PCIe inside one node (`intra_node.gbps`)
    fabric = "fabric"  # a cluster's own network between its nodes (`clusters[i].nic`)
    inter_cluster = "inter_cluster"  # Ethernet between clusters, or any communicator forced onto TCP


@dataclass(frozen=True)
class LinkClass:
    """The configured link two ranks use; `key` names it in `measured` files and in the probe's output.

    `clusters`: the clusters at its ends, () inside a node, (A,) inside cluster A (its fabric, or TCP forced inside
    it), (A, B) sorted between two clusters. `pair_listed`: that pair has its own entry in `inter_cluster.pairs`.
    """

    scope: LinkScope
    kind: LinkKind
    clusters: tuple[str, ...] = ()
    pair_listed: bool = False

    @property
    def key(self) -> str:
        """`intra_node`, `rdma:<cluster>`, `tcp:<cluster>` (a cluster without RDMA), `inter_cluster` or
        `inter_cluster:<A><-><B>` (a pair with its own speed)."""
        if self.scope is LinkScope.fabric:
            return f"{self.kind.value}:{self.clusters[0]}"
        if self.pair_listed:
            return self.pair_key
        return self.scope.value

    @property
    def pair_key(self) -> str:
        """`inter_cluster:<A><-><B>`, or `inter_cluster:<A>` for TCP forced inside cluster A: this very pair."""
        return f"{self.scope.value}:{PAIR_SEPARATOR.join(self.clusters)}"

    @property
    def measured_keys(self) -> tuple[str, ...]:
        """The keys a measured speed of this link may be given under, the most specific first: a TCP link's own pair
        of clusters (`pair_key`), then `key`."""
        if self.scope is LinkScope.inter_cluster and not self.pair_listed:
            return (self.pair_key, self.key)
        return (self.key,)

    def __str__(self) -> str:
        return self.key


PAIR_SEPARATOR = "<->"
TRANSPORT_ORDER = {LinkKind.TCP: 0, LinkKind.RDMA: 1, LinkKind.INTRA_NODE: 2}  # on equal speed, TCP is the bottleneck


@dataclass(frozen=True)
class Link:
    """A link's transport and the Gb/s it delivers; `line_gbps`: the configured line rate that derives from (None:
    measured)."""

    kind: LinkKind
    gbps: float
    line_gbps: float | None = None

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8

    @property
    def bottleneck_order(self) -> tuple[float, int]:
        """Sort key of the slowest link: lowest speed, then TCP before RDMA (a group with any TCP hop runs on TCP)."""
        return self.gbps, TRANSPORT_ORDER[self.kind]


@dataclass(frozen=True)
class Node:
    index: int
    name: str
    cluster: str
    nic: NICKind
    nic_gbps: float
    device_tflops: float
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class RankInfo:
    rank: int
    node: int
    local_device: int
    cluster: str
    nic: NICKind


@dataclass(frozen=True)
class NICGroup:
    """Ranks that share one cluster and one NIC kind: the only ranks a DP/sharding group may mix."""

    cluster: str
    nic: NICKind
    gbps: float
    ranks: tuple[int, ...]


def config_dir() -> Path:
    """The shipped Hydra config directory (`conf/` of the source tree, or the installed copy)."""
    for candidate in (Path(__file__).resolve().parents[2] / "conf", Path(__file__).resolve().parents[1] / "conf"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("holmes_lightning: shipped conf/ directory not found; install with `pip install -e .`")


def shipped_cluster_names() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "cluster").glob("*.yaml"))


def load_cluster_spec(source: str | Path | Mapping | DictConfig | ClusterSpec) -> ClusterSpec:
    """Validate a cluster config against the schema: a shipped name, a YAML path, a dict/DictConfig or a ClusterSpec."""
    if isinstance(source, ClusterSpec):
        return source
    if isinstance(source, str | Path) and not Path(source).suffix:
        path = config_dir() / "cluster" / f"{source}.yaml"
        if not path.exists():
            raise TopologyError(f"cluster={source!r}: no such config; shipped: {', '.join(shipped_cluster_names())}")
        source = path
    if isinstance(source, str | Path):
        if not Path(source).exists():
            raise TopologyError(f"cluster={str(source)!r}: file not found")
        raw = OmegaConf.load(source)
    else:
        raw = OmegaConf.create(source if isinstance(source, DictConfig) else dict(source))
    if "defaults" in raw:
        raw.pop("defaults")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ClusterSpec), raw)
    except Exception as err:  # omegaconf raises several types; all mean "this key or value is wrong"
        raise _schema_error(err, raw) from err
    return OmegaConf.to_object(merged)


def _schema_error(err: Exception, raw: DictConfig) -> TopologyError:
    """The error with the field as the config spells it (OmegaConf's key drops the index of a list entry)."""
    key = getattr(err, "full_key", "") or "?"
    for i, entry in enumerate(raw.get("clusters") or []):
        try:
            OmegaConf.merge(OmegaConf.structured(ClusterGroupSpec), entry)
        except Exception as entry_err:  # the first cluster entry that is wrong on its own
            err, key = entry_err, f"clusters[{i}].{getattr(entry_err, 'full_key', '') or '?'}"
            break
    first_line = str(err).splitlines()[0]
    return TopologyError(f"cluster.{key}: {first_line} (see conf/cluster/*.yaml for the schema)")


class Topology:
    """The hardware of one job, ranks numbered node-major in config order (as launchers number them)."""

    def __init__(self, spec: ClusterSpec, measured: Mapping[str, float] | None = None):
        _validate(spec)
        self.spec = spec
        self.name = spec.name
        self.measured: dict[str, float] = dict(measured or {})
        nodes: list[Node] = []
        ranks: list[RankInfo] = []
        for group in spec.clusters:
            devices = _devices_per_node(spec, group)
            for i in range(group.nodes):
                index = len(nodes)
                node_ranks = tuple(range(len(ranks), len(ranks) + devices))
                name = group.hostnames[i] if group.hostnames else f"{group.name}-node{i}"
                nic = NICKind(group.nic.kind)
                tflops = group.device_tflops or spec.device_tflops
                nodes.append(Node(index, name, group.name, nic, group.nic.gbps, tflops, node_ranks))
                ranks.extend(RankInfo(r, index, r - node_ranks[0], group.name, nic) for r in node_ranks)
        self.nodes: tuple[Node, ...] = tuple(nodes)
        self.ranks: tuple[RankInfo, ...] = tuple(ranks)
        self._cluster_gbps = {group.name: group.nic.gbps for group in spec.clusters}
        self._cluster_nic = {group.name: NICKind(group.nic.kind) for group in spec.clusters}
        self._pair_gbps = {frozenset(pair.clusters): pair.gbps for pair in spec.inter_cluster.pairs}
        self._links: dict[LinkClass, Link] = {}

    @classmethod
    def from_config(cls, source: str | Path | Mapping | DictConfig | ClusterSpec, **overrides: Any) -> Topology:
        """Build from a shipped config name, a YAML path, a dict/DictConfig or a ClusterSpec; overrides patch keys."""
        spec = load_cluster_spec(source)
        if overrides:
            spec = load_cluster_spec(OmegaConf.merge(OmegaConf.structured(spec), overrides))
        measured = _load_measured(spec.measured) if spec.measured else None
        return cls(spec, measured)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def node_of(self, rank: int) -> Node:
        return self.nodes[self.ranks[rank].node]

    def device_tflops(self, rank: int) -> float:
        return self.node_of(rank).device_tflops

    def link_class(self, a: int, b: int, rdma: bool = True) -> LinkClass:
        """The configured link two ranks communicate over (`rdma=False`: a communicator forced onto TCP sockets)."""
        node_a, node_b = self.node_of(a), self.node_of(b)
        if node_a.index == node_b.index:
            return LinkClass(LinkScope.intra_node, LinkKind.INTRA_NODE)
        return self._between_nodes(node_a.cluster, node_b.cluster, rdma)

    def link(self, a: int, b: int, rdma: bool = True) -> Link:
        """The link two ranks communicate over, with its bandwidth (measured where a probe gave one).

        `rdma=False` is a communicator forced onto TCP sockets (NCCL's "Socket" net, as a NIC-unaware job must use
        when IB and RoCE nodes share a communicator): then only the Ethernet network carries the traffic.
        """
        return self.link_of(self.link_class(a, b, rdma))

    def link_of(self, link_class: LinkClass) -> Link:
        """A link class's speed: measured if a probe gave one (`LinkClass.measured_keys`), else configured (never
        above either end's NIC) at its transport's efficiency."""
        if link_class not in self._links:
            self._links[link_class] = self._link_of(link_class)
        return self._links[link_class]

    def _link_of(self, link_class: LinkClass) -> Link:
        measured = next((self.measured[key] for key in link_class.measured_keys if key in self.measured), None)
        if measured is None and link_class.scope is LinkScope.inter_cluster:
            measured = self.measured.get(LinkScope.inter_cluster.value)  # probe files from before per-pair links
        if measured is not None:
            return Link(link_class.kind, measured)
        if link_class.scope is LinkScope.intra_node:
            line = self.spec.intra_node.gbps
        elif link_class.scope is LinkScope.fabric:
            line = self._cluster_gbps[link_class.clusters[0]]
        else:
            configured = self._pair_gbps.get(frozenset(link_class.clusters), self.spec.inter_cluster.gbps)
            line = min(configured, *(self._cluster_gbps[c] for c in link_class.clusters))
        return Link(link_class.kind, line * self.transport_efficiency(link_class.kind), line)

    def transport_efficiency(self, kind: LinkKind) -> float:
        """The share of its configured line rate a link of this transport delivers (`cluster.transport_efficiency`)."""
        return getattr(self.spec.transport_efficiency, kind.value)

    def cluster_link(self, a: str, b: str, rdma: bool = True) -> Link:
        """The link between a node of cluster `a` and another node of cluster `b` (`a == b`: inside its fabric)."""
        return self.link_of(self._between_nodes(a, b, rdma))

    def slowest_link(self, ranks: tuple[int, ...] | list[int], rdma: bool = True) -> Link:
        """The bottleneck link of a collective over these ranks (a ring is as fast as its slowest hop).

        Computed per node and cluster present, not per pair of ranks; on equal speed a TCP hop wins.
        """
        if len(ranks) < 2:
            return self.link_of(LinkClass(LinkScope.intra_node, LinkKind.INTRA_NODE))
        per_node: dict[int, int] = {}
        for rank in ranks:
            node = self.ranks[rank].node
            per_node[node] = per_node.get(node, 0) + 1
        per_cluster: dict[str, int] = {}
        for node in per_node:
            cluster = self.nodes[node].cluster
            per_cluster[cluster] = per_cluster.get(cluster, 0) + 1
        links = (
            [self.link_of(LinkClass(LinkScope.intra_node, LinkKind.INTRA_NODE))] if max(per_node.values()) > 1 else []
        )
        clusters = list(per_cluster)
        links += [self.cluster_link(c, c, rdma) for c in clusters if per_cluster[c] > 1]
        links += [self.cluster_link(a, b, rdma) for i, a in enumerate(clusters) for b in clusters[i + 1 :]]
        return min(links, key=lambda link: link.bottleneck_order)

    def _between_nodes(self, a: str, b: str, rdma: bool) -> LinkClass:
        """The class of a link between two different nodes, of clusters `a` and `b`."""
        if a == b:  # one cluster has one NIC kind: its own fabric
            if self._cluster_nic[a].is_rdma and rdma:
                return LinkClass(LinkScope.fabric, LinkKind.RDMA, (a,))
            if not self._cluster_nic[a].is_rdma:
                return LinkClass(LinkScope.fabric, LinkKind.TCP, (a,))
            return LinkClass(LinkScope.inter_cluster, LinkKind.TCP, (a,))
        pair = (a, b) if a < b else (b, a)
        return LinkClass(LinkScope.inter_cluster, LinkKind.TCP, pair, pair_listed=frozenset(pair) in self._pair_gbps)

    def nic_groups(self) -> tuple[NICGroup, ...]:
        """Ranks grouped by (cluster, NIC kind), in config order."""
        groups: dict[tuple[str, NICKind], list[int]] = {}
        gbps: dict[tuple[str, NICKind], float] = {}
        for node in self.nodes:
            key = (node.cluster, node.nic)
            groups.setdefault(key, []).extend(node.ranks)
            gbps[key] = min(gbps.get(key, node.nic_gbps), node.nic_gbps)
        return tuple(NICGroup(c, k, gbps[(c, k)], tuple(r)) for (c, k), r in groups.items())

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            per_node = sorted({len(n.ranks) for n in self.nodes})
            raise TopologyError(
                f"world size {world_size} from the launcher does not match cluster {self.name!r}, which has "
                f"{len(self.nodes)} nodes x {per_node} devices = {self.world_size} ranks; fix cluster.devices_per_node "
                f"or the clusters' `nodes`, or launch {self.world_size} processes"
            )

    def without(self, lost: Iterable[str]) -> Topology:
        """The same machines less the nodes named in `lost` (`Node.name`: a hostname, or `<cluster>-node<i>`), ranks
        numbered again node-major in config order; see `keeping`."""
        lost = set(lost)
        unknown = sorted(lost - {node.name for node in self.nodes})
        if unknown:
            raise TopologyError(f"lost nodes {unknown} are not in cluster {self.name!r}; name nodes as it lists them")
        return self.keeping([node.name for node in self.nodes if node.name not in lost])

    def keeping(self, names: Sequence[str]) -> Topology:
        """The nodes named, in the order given, as a smaller config: clusters in the order their first node comes,
        ranks numbered node-major in that order. A cluster with no node named is dropped with its `pairs` entries;
        nodes without hostnames are named again in the smaller config. A cluster's nodes must come one after another.
        """
        by_name = {node.name: node for node in self.nodes}
        unknown = [name for name in names if name not in by_name]
        if unknown or len(set(names)) < len(names):
            raise TopologyError(f"nodes {list(names)}: each must be a node of cluster {self.name!r}, named once")
        if not names:
            raise TopologyError(f"every node of cluster {self.name!r} is lost; nothing is left to train on")
        order: dict[str, list[str]] = {}
        for name in names:
            cluster = by_name[name].cluster
            if cluster in order and cluster != list(order)[-1]:
                raise TopologyError(
                    f"nodes {list(names)}: cluster {cluster!r}'s nodes are not one after another; a cluster's ranks "
                    f"must be consecutive"
                )
            order.setdefault(cluster, []).append(name)
        groups = {group.name: group for group in self.spec.clusters}
        clusters = [
            replace(groups[name], nodes=len(kept), hostnames=kept if groups[name].hostnames else None)
            for name, kept in order.items()
        ]
        pairs = [pair for pair in self.spec.inter_cluster.pairs if set(pair.clusters) <= set(order)]
        spec = replace(self.spec, clusters=clusters, inter_cluster=replace(self.spec.inter_cluster, pairs=pairs))
        return Topology(spec, self.measured)

    def homogeneous(self) -> Topology:
        """The same machines with every inter-node link at the fastest NIC's speed, delivered as its transport does
        (between clusters too): the limit Holmes approaches."""
        fastest = max(node.nic_gbps for node in self.nodes)
        best_kind = max(self.nodes, key=lambda node: (node.nic.is_rdma, node.nic_gbps)).nic
        groups = [replace(g, nic=replace(g.nic, kind=best_kind, gbps=fastest)) for g in self.spec.clusters]
        delivered = self.transport_efficiency(LinkKind.RDMA if best_kind.is_rdma else LinkKind.TCP)
        spec = replace(
            self.spec,
            name=f"{self.name}_homogeneous",
            clusters=groups,
            inter_cluster=InterClusterSpec(fastest),
            transport_efficiency=replace(self.spec.transport_efficiency, tcp=delivered),
        )
        return Topology(spec)

    def to_dict(self) -> dict:
        return {"spec": asdict(self.spec), "measured": self.measured}

    @classmethod
    def from_dict(cls, data: Mapping) -> Topology:
        return cls(load_cluster_spec(data["spec"]), data.get("measured"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"Topology({self.name!r}, world_size={self.world_size}, nodes={len(self.nodes)})"

    def __str__(self) -> str:
        lines = [f"Topology {self.name!r}: {self.world_size} ranks on {len(self.nodes)} nodes"]
        lines.append(f"  {'node':<16}{'cluster':<10}{'nic':<12}{'Gb/s':>7}{'TFLOPS':>8}  ranks")
        for node in self.nodes:
            ranks = ",".join(map(str, node.ranks))
            lines.append(
                f"  {node.name:<16}{node.cluster:<10}{node.nic.value:<12}{node.nic_gbps:>7g}"
                f"{node.device_tflops:>8g}  {ranks}"
            )
        lines.append("  NIC groups (DP/sharding groups stay inside one):")
        for group in self.nic_groups():
            lines.append(f"    {group.cluster}/{group.nic.value}: ranks {list(group.ranks)} at {group.gbps:g} Gb/s")
        lines.append(
            f"  links:  {'class (key of measured files)':<30}{'between':<14}{'transport':<11}{'delivers':>13}"
            f"  {'of':<16}"
        )
        for link_class, example in self._link_classes():
            link = self.link_of(link_class)
            ends = "<->".join(link_class.clusters) if link_class.scope is LinkScope.inter_cluster else ""
            source = "measured" if link.line_gbps is None else f"{link.line_gbps:g} Gb/s line"
            lines.append(
                f"          {link_class.key:<30}{ends:<14}{link.kind.value:<11}{link.gbps:>8.4g} Gb/s  {source:<16}"
                f"e.g. ranks {example[0]}<->{example[1]}"
            )
        return "\n".join(lines)

    def _link_classes(self) -> list[tuple[LinkClass, tuple[int, int]]]:
        """Every link class that joins two ranks, with one pair of ranks on it (per node and cluster, not per pair)."""
        first_node: dict[str, Node] = {}
        second_node: dict[str, Node] = {}
        for node in self.nodes:
            (second_node if node.cluster in first_node else first_node).setdefault(node.cluster, node)
        found: dict[LinkClass, tuple[int, int]] = {}
        wide = next((node for node in self.nodes if len(node.ranks) > 1), None)
        if wide is not None:
            found[self.link_class(*wide.ranks[:2])] = (wide.ranks[0], wide.ranks[1])
        for cluster, node in second_node.items():
            found.setdefault(
                self.link_class(first_node[cluster].ranks[0], node.ranks[0]),
                (first_node[cluster].ranks[0], node.ranks[0]),
            )
        clusters = list(first_node.values())
        for i, a in enumerate(clusters):
            for b in clusters[i + 1 :]:
                found.setdefault(self.link_class(a.ranks[0], b.ranks[0]), (a.ranks[0], b.ranks[0]))
        return list(found.items())


def _devices_per_node(spec: ClusterSpec, group: ClusterGroupSpec) -> int:
    return group.devices_per_node if group.devices_per_node is not None else spec.devices_per_node


def _positive(value: float | int | None, field_name: str, fix: str) -> None:
    if value is None or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise TopologyError(f"{field_name}={value!r}: must be a finite number > 0; {fix}")


def _validate(spec: ClusterSpec) -> None:
    kinds = ", ".join(k.value for k in NICKind)
    if not spec.clusters:
        raise TopologyError(f"cluster {spec.name!r}: `clusters` is empty; list at least one cluster with nodes, nic")
    _positive(spec.devices_per_node, "cluster.devices_per_node", "set the GPUs per node, e.g. 8")
    _positive(spec.device_tflops, "cluster.device_tflops", "set the device's dense peak, e.g. 312 for A100 bf16")
    _positive(spec.intra_node.gbps, "cluster.intra_node.gbps", "set the NVLink/PCIe speed, e.g. 2400")
    _positive(spec.inter_cluster.gbps, "cluster.inter_cluster.gbps", "set the Ethernet speed between clusters")
    for kind in LinkKind:
        share = getattr(spec.transport_efficiency, kind.value)
        if not 0 < share <= 1:
            raise TopologyError(
                f"cluster.transport_efficiency.{kind.value}={share}: give the share of line rate the transport "
                f"delivers, in (0, 1] (or measure the links with holmes_lightning.cli.probe)"
            )
    names = [c.name for c in spec.clusters]
    _validate_pairs(spec.inter_cluster, names)
    for i, group in enumerate(spec.clusters):
        where = f"cluster.clusters[{i}]"
        if not group.name or group.name == "???":
            raise TopologyError(f"{where}.name is missing; give each cluster a unique name")
        if names.count(group.name) > 1:
            raise TopologyError(f"{where}.name={group.name!r} is used twice; cluster names must be unique")
        if group.nic.kind is None:
            raise TopologyError(f"{where}.nic.kind is unset; detect it with detect_node_nic() or set one of: {kinds}")
        if group.nic.kind not in {k.value for k in NICKind}:
            raise TopologyError(f"{where}.nic.kind={group.nic.kind!r} is not a NIC kind; use one of: {kinds}")
        _positive(group.nodes, f"{where}.nodes", "a cluster needs at least one node")
        _positive(group.nic.gbps, f"{where}.nic.gbps", "set the NIC's port speed, e.g. 200")
        _positive(_devices_per_node(spec, group), f"{where}.devices_per_node", "set the GPUs per node, e.g. 8")
        if group.device_tflops is not None:
            _positive(group.device_tflops, f"{where}.device_tflops", "set the device's peak TFLOPS or remove it")
        _check_nccl_settings(f"{where}.nic", group.nic)
        if group.hostnames is not None and len(group.hostnames) != group.nodes:
            raise TopologyError(
                f"{where}.hostnames has {len(group.hostnames)} names for {group.nodes} nodes; give one per node"
            )
    hostnames = [h for c in spec.clusters for h in (c.hostnames or [])]
    duplicates = sorted({h for h in hostnames if hostnames.count(h) > 1})
    if duplicates:
        raise TopologyError(f"cluster.clusters[*].hostnames: {duplicates} appear twice; each node needs its own name")


def _check_nccl_settings(where: str, nic: NICSpec) -> None:
    """The NCCL names a cluster's nodes use: device[:port] names, a GID index for RoCE, an interface name."""
    if nic.hca is not None and (not nic.hca or not all(NCCL_DEVICE.fullmatch(hca) for hca in nic.hca)):
        raise TopologyError(f"{where}.hca={nic.hca!r}: list RDMA devices as NCCL names them, e.g. [mlx5_0:1, mlx5_1:1]")
    if nic.gid_index is not None and (nic.gid_index < 0 or nic.kind == NICKind.infiniband):
        raise TopologyError(
            f"{where}.gid_index={nic.gid_index!r}: a RoCE GID index is >= 0 (`show_gids` lists them; RoCE v2 is "
            f"often 3), and InfiniBand has none; remove it for kind infiniband"
        )
    if nic.socket_ifname is not None and not NCCL_DEVICE.fullmatch(nic.socket_ifname):
        raise TopologyError(f"{where}.socket_ifname={nic.socket_ifname!r}: name one network interface, e.g. eth0")


def _validate_pairs(inter_cluster: InterClusterSpec, names: list[str]) -> None:
    """Each listed pair: two different known clusters, listed once, with a positive speed."""
    seen: dict[frozenset[str], int] = {}
    for i, pair in enumerate(inter_cluster.pairs):
        where = f"cluster.inter_cluster.pairs[{i}]"
        if len(pair.clusters) != 2 or pair.clusters[0] == pair.clusters[1]:
            raise TopologyError(
                f"{where}.clusters={list(pair.clusters)}: name two different clusters, e.g. "
                f"{{clusters: [{', '.join(names[:2])}], gbps: 25}}"
            )
        unknown = [name for name in pair.clusters if name not in names]
        if unknown:
            raise TopologyError(f"{where}.clusters: {unknown} is not a cluster of this config; use names from {names}")
        key = frozenset(pair.clusters)
        if key in seen:
            raise TopologyError(
                f"{where}: the pair {sorted(key)} is already given by inter_cluster.pairs[{seen[key]}]; "
                f"list each pair of clusters once"
            )
        seen[key] = i
        _positive(pair.gbps, f"{where}.gbps", "set the link's speed between these two clusters")


def _load_measured(path: str) -> dict[str, float]:
    """Bandwidths measured by `holmes_lightning.cli.probe` (JSON: link class -> Gb/s) replace the configured ones."""
    file = Path(path)
    if not file.exists():
        raise TopologyError(f"cluster.measured={path!r}: file not found; write it with holmes_lightning.cli.probe")
    data = json.loads(file.read_text())
    links = data.get("links", data)
    return {str(k): float(v) for k, v in links.items()}
