"""NCCL's network settings: the net each process group uses, and what each process sets before its first communicator.

Inside one RDMA fabric NCCL chooses its own net (its IB plugin serves InfiniBand and RoCE; forcing "IB" breaks nodes
whose fabric another plugin serves). Only a group whose ranks share no RDMA fabric is forced onto TCP sockets. NCCL
reads its environment once per process, when the first communicator is built, so the socket interface (by default
NCCL prefers `ib*` IPoIB interfaces, which do not reach the other cluster), the HCAs and RoCE's GID index are set per
process, per node, before that: from the cluster config where it gives them, the interface detected from the node's
address otherwise. A variable the user set wins, and the log says so. Pure functions here; `apply` is the one step
that touches the environment.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from holmes_lightning.topology import ClusterGroupSpec, ClusterSpec, LinkKind, NICKind

SOCKET_NET = "Socket"
# NCCL's TCP transport defaults to 1 thread x 1 socket per peer (1-3 GB/s on 100 GbE); nccl-tests reach 4-6 GB/s
# with several of each (their product at most 64)
SOCKET_PARALLELISM = {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def group_net(link: LinkKind, environ: Mapping[str, str]) -> str | None:
    """`net_name` for an NCCL group whose slowest hop is `link`: sockets across fabrics, else NCCL's own choice.

    None also when the user set NCCL_NET: it then decides for every communicator.
    """
    if "NCCL_NET" in environ:
        return None
    return SOCKET_NET if link is LinkKind.TCP else None


@dataclass(frozen=True)
class ProcessSettings:
    """The NCCL variables this process sets (`values`), and those the user set already, which win (`overruled`:
    name -> (the user's value, ours))."""

    values: dict[str, str] = field(default_factory=dict)
    overruled: dict[str, tuple[str, str]] = field(default_factory=dict)

    def notes(self) -> list[str]:
        """One line per decision, for the log."""
        lines = [f"{name}={value}" for name, value in self.values.items()]
        lines += [
            f"{name}={theirs} from the environment wins (ours: {ours})"
            for name, (theirs, ours) in self.overruled.items()
        ]
        return lines


def process_settings(
    environ: Mapping[str, str],
    socket_interface: str | None,
    hcas: Sequence[str] | None = None,
    gid_index: int | None = None,
) -> ProcessSettings:
    """What this process sets before its first NCCL communicator; names match exactly (NCCL's `=` prefix). With a
    socket interface (a job of several nodes, whose groups across NIC kinds run on TCP) the sockets in parallel."""
    wanted = {}
    if socket_interface:
        wanted["NCCL_SOCKET_IFNAME"] = f"={socket_interface}"
        wanted.update(SOCKET_PARALLELISM)
    if hcas:
        wanted["NCCL_IB_HCA"] = "=" + ",".join(hcas)
    if gid_index is not None:
        wanted["NCCL_IB_GID_INDEX"] = str(gid_index)
    values = {name: value for name, value in wanted.items() if name not in environ}
    overruled = {name: (environ[name], value) for name, value in wanted.items() if name in environ}
    if "NCCL_NET" in environ:
        overruled["NCCL_NET"] = (environ["NCCL_NET"], "Socket only for groups that span NIC kinds")
    return ProcessSettings(values, overruled)


def world_link(spec: ClusterSpec) -> LinkKind:
    """The slowest link of the default group (every rank), from the config alone: it is built before detection."""
    if len(_node_clusters(spec)) == 1:
        return LinkKind.INTRA_NODE
    kinds = {group.nic.kind for group in spec.clusters}
    one_fabric = len(spec.clusters) == 1 and None not in kinds and NICKind(spec.clusters[0].nic.kind).is_rdma
    return LinkKind.RDMA if one_fabric else LinkKind.TCP


def _node_clusters(spec: ClusterSpec) -> list[ClusterGroupSpec]:
    """The cluster of each node, by node rank."""
    return [group for group in spec.clusters for _ in range(group.nodes)]


def _cluster_of_node(spec: ClusterSpec, node_rank: int) -> ClusterGroupSpec | None:
    clusters = _node_clusters(spec)
    return clusters[node_rank] if node_rank < len(clusters) else None  # a wrong node count is reported at the exchange


def node_settings(
    spec: ClusterSpec, node_rank: int, environ: Mapping[str, str], detected_interface: str | None
) -> ProcessSettings:
    """This node's NCCL environment: its cluster's `nic.hca` / `nic.gid_index`, and for jobs of several nodes the
    socket interface `nic.socket_ifname`, else `detected_interface` (the one holding the node's address)."""
    group = _cluster_of_node(spec, node_rank)
    if group is None:
        return ProcessSettings()
    several_nodes = len(_node_clusters(spec)) > 1
    interface = (group.nic.socket_ifname or detected_interface) if several_nodes else None
    return process_settings(environ, interface, group.nic.hca, group.nic.gid_index)


def set_up_process(
    spec: ClusterSpec, node_rank: int, node_address: str | None, rendezvous: tuple[str, int]
) -> ProcessSettings:
    """Decide and set this process's NCCL environment; call it before the process's first NCCL communicator.

    The socket interface is detected only where needed: the interface holding `node_address`, or else the address
    this node reaches the rendezvous (`MASTER_ADDR`) from.
    """
    group = _cluster_of_node(spec, node_rank)
    detect = group is not None and not group.nic.socket_ifname and "NCCL_SOCKET_IFNAME" not in os.environ
    detected = None
    if detect and len(_node_clusters(spec)) > 1:
        detected = interface_holding(node_address or address_towards(*rendezvous), local_interfaces())
    settings = node_settings(spec, node_rank, os.environ, detected)
    os.environ.update(settings.values)
    return settings


def interface_holding(address: str, interfaces: Mapping[str, Sequence[str]]) -> str | None:
    """The interface that carries `address` (an IP), given each interface's addresses; None if none does."""
    wanted = ipaddress.ip_address(address)
    for name, addresses in sorted(interfaces.items()):
        if any(ipaddress.ip_address(a) == wanted for a in addresses):
            return name
    return None


def local_interfaces(proc_net: Path = Path("/proc/net")) -> dict[str, list[str]]:
    """This machine's interfaces and their IP addresses (IPv4 from the kernel, IPv6 from /proc/net/if_inet6)."""
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _index, name in socket.if_nameindex():
            request = array.array("B", struct.pack("256s", name.encode()[:15]))
            try:
                fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
            except OSError:  # no IPv4 address
                continue
            found.setdefault(name, []).append(socket.inet_ntoa(request[20:24].tobytes()))
    inet6 = proc_net / "if_inet6"
    for entry in inet6.read_text().splitlines() if inet6.is_file() else []:
        hex_address, *_, name = entry.split()
        found.setdefault(name, []).append(str(ipaddress.IPv6Address(bytes.fromhex(hex_address))))
    return found


def address_towards(host: str, port: int) -> str:
    """This node's address on the route to `host` (the rendezvous): the Ethernet address the other nodes reach."""
    family, kind, proto, _name, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(target)  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]
