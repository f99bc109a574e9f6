"""The lab's network as plain data: one namespace per node, two addresses per node, and each node's egress classes."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from holmes_lightning.topology import LinkClass, LinkKind, LinkScope, Topology, TopologyError

ETHERNET_NET = "10.213.1"  # both /24s exist only inside the lab's namespaces
FABRIC_NET = "10.213.2"
STORE_ADDRESS = f"{ETHERNET_NET}.254"  # the bridge's own: where a DiLoCo job's sites meet, on no node that can be lost
MAX_NODES = 250
MAX_LAB_MBIT = 2000.0  # above this the shared CPU, not tc, limits veth traffic and shaping stops being exact
NAMESPACE_PATTERN = re.compile(r"^holmes-(\d+)-(br|n\d+)$")


@dataclass(frozen=True)
class EgressClass:
    """One HTB class on a node's egress: a link class, its real and lab rate, and the addresses it carries to."""

    link_class: str
    gbps: float
    lab_mbit: float
    destinations: tuple[str, ...]


@dataclass(frozen=True)
class LabNode:
    index: int
    name: str
    namespace: str
    ethernet: str
    fabric: str | None
    egress: tuple[EgressClass, ...]


@dataclass(frozen=True)
class LabNetwork:
    bridge: str
    nodes: tuple[LabNode, ...]
    bandwidth_scale: float

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Every namespace of the run, the bridge last (removing a node first also removes its veth)."""
        return (*(node.namespace for node in self.nodes), self.bridge)


def run_prefix(pid: int | None = None) -> str:
    """Namespace names of one run start with this; the cleanup command reads the owner's pid back from it."""
    return f"holmes-{os.getpid() if pid is None else pid}-"


def format_scale(scale: float) -> str:
    """0.002 -> 1/500."""
    inverse = 1 / scale
    if scale >= 1:
        return f"{scale:g}"
    return f"1/{inverse:.0f}" if abs(inverse - round(inverse)) < 1e-6 * inverse else f"1/{inverse:.4g}"


def design_network(topology: Topology, bandwidth_scale: float, pid: int | None = None) -> LabNetwork:
    """Addresses and egress classes of every node; rates are the configured speeds (not `measured`) x the scale."""
    if isinstance(bandwidth_scale, bool) or not bandwidth_scale > 0:
        raise TopologyError(f"lab.bandwidth_scale={bandwidth_scale!r}: must be > 0, e.g. 0.002 (200 Gb/s -> 400 Mb/s)")
    if len(topology.nodes) > MAX_NODES:
        raise TopologyError(
            f"cluster {topology.name!r} has {len(topology.nodes)} nodes; the lab emulates at most {MAX_NODES} "
            f"on one machine: use a smaller cluster config or lab=loopback"
        )
    configured = Topology(topology.spec)
    prefix = run_prefix(pid)
    ethernet = [f"{ETHERNET_NET}.{node.index + 1}" for node in configured.nodes]
    fabric = [f"{FABRIC_NET}.{node.index + 1}" if node.nic.is_rdma else None for node in configured.nodes]
    nodes = []
    for node in configured.nodes:
        classes: dict[tuple[str, float], list[str]] = {}
        for peer in configured.nodes:
            if peer.index == node.index:
                continue
            for address, rdma in ((ethernet[peer.index], False), (fabric[peer.index], True)):
                if address is not None:
                    a, b = node.ranks[0], peer.ranks[0]
                    key = (configured.link_class(a, b, rdma).key, configured.link(a, b, rdma).gbps)
                    classes.setdefault(key, []).append(address)
        egress = tuple(
            EgressClass(link_class, gbps, gbps * 1000 * bandwidth_scale, tuple(destinations))
            for (link_class, gbps), destinations in classes.items()
        )
        nodes.append(
            LabNode(node.index, node.name, f"{prefix}n{node.index}", ethernet[node.index], fabric[node.index], egress)
        )
    fastest = max((c for node in nodes for c in node.egress), key=lambda c: c.lab_mbit, default=None)
    if fastest is not None and fastest.lab_mbit > MAX_LAB_MBIT:
        raise TopologyError(
            f"lab.bandwidth_scale={bandwidth_scale:g} makes {fastest.link_class} ({fastest.gbps:g} Gb/s) "
            f"{fastest.lab_mbit:.0f} Mb/s, above the {MAX_LAB_MBIT:.0f} Mb/s this machine shapes exactly; use at most "
            f"{MAX_LAB_MBIT / 1000 / fastest.gbps:.2g}"
        )
    return LabNetwork(f"{prefix}br", tuple(nodes), bandwidth_scale)


def emulated_topology(topology: Topology, bandwidth_scale: float) -> Topology:
    """`topology` as the lab runs it: the same cluster config, every link measured at its configured speed x
    `bandwidth_scale`, keyed as measured speeds are (`LinkClass.measured_keys`). The lab starts its ranks as this
    cluster, so HolmesStrategy plans for the links the job has, as on a real cluster with measured links."""
    configured = Topology(topology.spec)
    firsts = [node.ranks[0] for node in configured.nodes]
    classes = {LinkClass(LinkScope.intra_node, LinkKind.INTRA_NODE)}
    classes.update(
        configured.link_class(a, b, rdma) for a in firsts for b in firsts if a != b for rdma in (True, False)
    )
    links = {link_class.measured_keys[0]: configured.link_of(link_class).gbps for link_class in classes}
    return Topology(topology.spec, {key: gbps * bandwidth_scale for key, gbps in links.items()})


def describe(network: LabNetwork) -> str:
    """A table of the emulated nodes: namespace, addresses, and the rate of each egress class."""
    lines = [f"  {'node':<14}{'namespace':<20}{'ethernet':<13}{'fabric':<13}egress (real -> lab)"]
    for node in network.nodes:
        rates = "; ".join(f"{c.link_class} {c.gbps:g} Gb/s -> {c.lab_mbit:.3g} Mb/s" for c in node.egress)
        lines.append(f"  {node.name:<14}{node.namespace:<20}{node.ethernet:<13}{node.fabric or '-':<13}{rates}")
    return "\n".join(lines)
