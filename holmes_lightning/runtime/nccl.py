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
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from holmes_lightning.topology import LinkKind

SOCKET_NET = "Socket"
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
    """What this process sets before its first NCCL communicator; names match exactly (NCCL's `=` prefix)."""
    wanted = {}
    if socket_interface:
        wanted["NCCL_SOCKET_IFNAME"] = f"={socket_interface}"
    if hcas:
        wanted["NCCL_IB_HCA"] = "=" + ",".join(hcas)
    if gid_index is not None:
        wanted["NCCL_IB_GID_INDEX"] = str(gid_index)
    values = {name: value for name, value in wanted.items() if name not in environ}
    overruled = {name: (environ[name], value) for name, value in wanted.items() if name in environ}
    if "NCCL_NET" in environ:
        overruled["NCCL_NET"] = (environ["NCCL_NET"], "Socket only for groups that span NIC kinds")
    return ProcessSettings(values, overruled)


def apply(settings: ProcessSettings, environ: MutableMapping[str, str] = os.environ) -> None:
    environ.update(settings.values)


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
