"""Where the launcher's processes sit in the cluster config, and which device each one drives.

Launchers number ranks their own way: Lightning's launcher and `torchrun --standalone` put every process on node 0
(local rank = rank), `holmes-launch` and a real multi-node `torchrun` number node by node (torchrun's c10d
rendezvous in the sorted order of the nodes' addresses). `attend` maps the launcher's nodes to the config's (by
hostname where it names hosts) and forms the layout of the nodes present, in the launcher's order, so rank r of the
launch is rank r of that layout; `choose_device` picks each process's device.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from holmes_lightning.launch.processes import LAUNCHED_ENV
from holmes_lightning.topology import ClusterSpec, NICKind, Topology, TopologyError

NODE_ADDRESS_ENV = "HOLMES_NODE_ADDRESS"


@dataclass(frozen=True)
class RankReport:
    """What one rank found where it runs: the launcher's numbering, its host's names, its node's RDMA NIC."""

    rank: int
    node_rank: int
    local_rank: int
    host: tuple[str, ...]  # hostname first, then other names and addresses it answers to
    kind: NICKind
    gbps: float | None = None


def host_identity(environ: Mapping[str, str]) -> tuple[str, ...]:
    """This host's name, its short and fully qualified names and its addresses (the config may use any of them)."""
    name = socket.gethostname()
    names = [name, name.split(".")[0]]
    with contextlib.suppress(OSError):  # a host whose own name does not resolve still has its name
        canonical, aliases, addresses = socket.gethostbyname_ex(name)
        names += [canonical, *aliases, *addresses]
    if environ.get(NODE_ADDRESS_ENV):
        names.append(environ[NODE_ADDRESS_ENV])
    return tuple(dict.fromkeys(n.lower() for n in names if n))


def node_layout(spec: ClusterSpec) -> Topology:
    """The config's nodes and ranks; NIC kinds still to be detected do not change where ranks sit."""
    clusters = [replace(g, nic=replace(g.nic, kind=g.nic.kind or NICKind.ethernet)) for g in spec.clusters]
    return Topology(replace(spec, clusters=clusters))


def launch_mismatch(
    layout: Topology, world_size: int, trainer: tuple[int, int] | None = None, min_nodes: int | None = None
) -> str | None:
    """What to do when the launch runs `world_size` processes for a config of another size (None: sizes agree, or
    fewer processes may be fewer nodes: `min_nodes` is set and `attend` decides once they joined).

    `trainer`: (devices, num_nodes) when Lightning's own launcher starts the processes from the Trainer's flags.
    """
    expected = layout.world_size
    if world_size == expected or (min_nodes is not None and world_size < expected):
        return None
    shape = f"{len(layout.nodes)} nodes x {'/'.join(str(n) for n in sorted({len(n.ranks) for n in layout.nodes}))}"
    launchers = (
        f"`holmes-launch cluster={layout.name} -- python SCRIPT` or "
        f"`torchrun --standalone --nproc-per-node {expected} SCRIPT`"
    )
    if trainer is not None:
        devices, num_nodes = trainer
        return (
            f"cluster {layout.name!r} has {expected} ranks ({shape} devices) but Trainer(devices={devices}, "
            f"num_nodes={num_nodes}) starts {world_size}; pass Trainer(devices={expected}) to run every node on this "
            f"machine, or start the script with {launchers}"
        )
    fewer = (
        ", or let the job train on the nodes that join: HolmesStrategy(min_nodes=N) (train.py: elastic.min_nodes=N)"
        if world_size < expected
        else ""
    )
    return (
        f"world size {world_size} from the launcher does not match cluster {layout.name!r}, which has {shape} "
        f"devices = {expected} ranks; launch {expected} processes ({launchers}), or fix cluster.devices_per_node or "
        f"the clusters' `nodes`{fewer}"
    )


@dataclass(frozen=True)
class Attendance:
    """The config's nodes the launcher started: the layout they form (in the launcher's node order, rank r of the
    launch is its rank r), the config's names of the nodes missing, and whether one host plays every node."""

    layout: Topology
    missing: tuple[str, ...]
    emulated: bool

    def describe(self, config: Topology) -> str:
        """The one line that says which nodes of the config did not join."""
        return (
            f"HolmesStrategy: {len(self.layout.nodes)} of the {len(config.nodes)} nodes of cluster {config.name!r} "
            f"joined; missing: {', '.join(self.missing)}; planning for the nodes present"
        )


def attend(layout: Topology, reports: Sequence[RankReport], min_nodes: int | None = None) -> Attendance:
    """Map the launcher's nodes to the config's: by hostname where the config names hosts (torchrun numbers nodes its
    own way), in the config's order otherwise; one host running every process plays the config's first nodes.

    Fewer nodes than the config lists are refused unless `min_nodes` allows them; then the job plans for the
    `Attendance.layout` of the nodes present. Every rank's (node rank, local rank) must be its place there.
    """
    if (message := launch_mismatch(layout, len(reports), min_nodes=min_nodes)) is not None:
        raise TopologyError(message)
    launched = _launcher_nodes(reports)
    names = _one_node(layout, *launched[0]) if len(launched) == 1 else _matched(layout, launched)
    missing = tuple(node.name for node in layout.nodes if node.name not in names)
    if missing and min_nodes is None:
        raise TopologyError(launch_mismatch(layout, len(reports)))
    if min_nodes is not None and len(names) < min_nodes:
        raise TopologyError(
            f"{len(names)} of the {len(layout.nodes)} nodes of cluster {layout.name!r} joined (missing: "
            f"{', '.join(missing)}), fewer than min_nodes={min_nodes}; start more nodes or lower min_nodes"
        )
    present = layout if names == [node.name for node in layout.nodes] else _in_launch_order(layout, names)
    emulated = len(launched) == 1 and len(names) > 1
    if not emulated:
        _check_numbering(present, reports)
    return Attendance(present, missing, emulated)


def _launcher_nodes(reports: Sequence[RankReport]) -> list[tuple[tuple[str, ...], int]]:
    """Each launcher node's host names and process count, in node-rank order."""
    nodes: dict[int, list[RankReport]] = {}
    for report in reports:
        nodes.setdefault(report.node_rank, []).append(report)
    return [(nodes[index][0].host, len(nodes[index])) for index in sorted(nodes)]


def _one_node(layout: Topology, host: tuple[str, ...], world_size: int) -> list[str]:
    """The node a lone launcher node is named as, when it runs that node's processes; else the config's first nodes
    that hold `world_size` ranks, played by this one host."""
    groups = {group.name: group for group in layout.spec.clusters}
    for node in layout.nodes:
        if groups[node.cluster].hostnames and _is_host(node.name.lower(), host) and len(node.ranks) == world_size:
            return [node.name]
    names, ranks = [], 0
    for node in layout.nodes:
        if ranks >= world_size:
            break
        names.append(node.name)
        ranks += len(node.ranks)
    if ranks != world_size:
        sizes = "/".join(str(n) for n in sorted({len(node.ranks) for node in layout.nodes}))
        raise TopologyError(
            f"{world_size} processes on one host do not make whole nodes of cluster {layout.name!r} (its nodes hold "
            f"{sizes} ranks, in config order); start whole nodes"
        )
    return names


def _matched(layout: Topology, launched: list[tuple[tuple[str, ...], int]]) -> list[str]:
    """The config node each launcher node plays: the one its host is named as, else the next node of a cluster that
    names no hosts; all on one host (holmes-launch): the config's nodes in order."""
    groups = {group.name: group for group in layout.spec.clusters}
    named = [node for node in layout.nodes if groups[node.cluster].hostnames]
    one_host = len({host[0] for host, _ in launched}) == 1
    unnamed = iter(layout.nodes if one_host else [node for node in layout.nodes if not groups[node.cluster].hostnames])
    names: list[str] = []
    for index, (host, processes) in enumerate(launched):
        node = None if one_host else next((n for n in named if _is_host(n.name.lower(), host)), None)
        node = node or next(unnamed, None)
        if node is None or node.name in names:
            raise TopologyError(
                f"launcher node {index} runs on {host[0]!r}, a host cluster {layout.name!r} does not name (or names "
                f"for another launcher node too); list every host in its cluster's `hostnames`"
            )
        if processes != len(node.ranks):
            raise TopologyError(
                f"launcher node {index} ({host[0]!r}) runs {processes} processes but plays node {node.name!r} of "
                f"cluster {layout.name!r}, which has {len(node.ranks)} devices; start that many processes on it"
            )
        names.append(node.name)
    return names


def _in_launch_order(layout: Topology, names: list[str]) -> Topology:
    """The nodes present as a config of their own, in the launcher's order."""
    try:
        return layout.keeping(names)
    except TopologyError as err:
        raise TopologyError(
            f"the launcher's node order mixes clusters: {err}. torchrun's c10d rendezvous numbers nodes in the sorted "
            f"order of their --local-addr (default: the host's FQDN): give each node an address that sorts with its "
            f"cluster, or start each host with `torchrun --node-rank=<its index in the config>` (static rendezvous)"
        ) from err


def _check_numbering(layout: Topology, reports: Sequence[RankReport]) -> None:
    """Launchers that number node by node must give rank r the node and local rank it has in `layout`."""
    for report in reports:
        place = layout.ranks[report.rank]
        if (place.node, place.local_device) != (report.node_rank, report.local_rank):
            raise TopologyError(
                f"rank {report.rank} is node {report.node_rank} / local {report.local_rank} for the launcher but "
                f"node {place.node} / local {place.local_device} in cluster {layout.name!r}; launch nodes in the "
                f"config's order with cluster.devices_per_node processes each"
            )


def _is_host(name: str, host: tuple[str, ...]) -> bool:
    """A config hostname (or address) matches a host that answers to it, also by its short name."""
    return name in host or name.split(".")[0] in host


def describe_emulation(layout: Topology) -> str:
    """The one line that says a single host plays every node of the config."""
    nodes = ", ".join(f"{node.name}={_ranks(node.ranks)}" for node in layout.nodes)
    return (
        f"HolmesStrategy: {layout.world_size} processes on this host play the {len(layout.nodes)} nodes of cluster "
        f"{layout.name!r} (node=ranks: {nodes}); on real nodes, start cluster.devices_per_node processes per node"
    )


def _ranks(ranks: tuple[int, ...]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def host_position(environ: Mapping[str, str], local_rank: int, local_processes: int) -> tuple[int, int]:
    """This process's index among the job's processes on this host, and how many there are.

    holmes-launch numbers LOCAL_RANK per emulated node but runs every rank here: then the global rank counts.
    Otherwise the launcher's local rank, out of torchrun's LOCAL_WORLD_SIZE or the Trainer's devices.
    """
    if LAUNCHED_ENV in environ:
        return int(environ["RANK"]), int(environ["WORLD_SIZE"])
    return local_rank, int(environ.get("LOCAL_WORLD_SIZE", local_processes))


def choose_device(
    given: Sequence[torch.device], visible: int, host_rank: int, host_ranks: int, backend: str
) -> torch.device:
    """The device of the `host_rank`-th of `host_ranks` processes on this host; two NCCL ranks never share a GPU.

    `given` is the Trainer's device list (Lightning's choice is `given[local rank]`), `visible` how many devices of
    that type this host shows. When the Trainer names fewer devices than the host runs ranks (train.py asks for one
    device per emulated node), each process takes the next visible device.
    """
    kind = given[0].type
    if kind == "cpu":
        return torch.device("cpu")
    if host_ranks <= len(given):
        return given[host_rank]
    if host_ranks <= visible:
        return torch.device(kind, host_rank)
    if backend == "nccl":
        raise TopologyError(
            f"{host_ranks} ranks run on this host but it has {visible} {kind} device(s): NCCL cannot put two ranks "
            f"on one GPU; run at most {visible} ranks per host (cluster.devices_per_node, or more hosts), or train on "
            f"CPU with Trainer(accelerator='cpu')"
        )
    return torch.device(kind, host_rank % max(visible, 1))
