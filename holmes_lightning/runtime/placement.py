"""Where the launcher's processes sit in the cluster config, and which device each one drives.

Launchers number ranks their own way: Lightning's launcher and `torchrun --standalone` put every process on node 0
(local rank = rank), `holmes-launch` and a real multi-node `torchrun` number node by node (torchrun's c10d
rendezvous in the order hosts joined). Rank r always plays the config's rank r; these functions check that the
launcher's nodes agree with the config's, or that one host plays them all, and pick each process's device.
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


def launch_mismatch(layout: Topology, world_size: int, trainer: tuple[int, int] | None = None) -> str | None:
    """What to do when the launch runs `world_size` processes for a config of another size (None: sizes agree).

    `trainer`: (devices, num_nodes) when Lightning's own launcher starts the processes from the Trainer's flags.
    """
    expected = layout.world_size
    if world_size == expected:
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
    return (
        f"world size {world_size} from the launcher does not match cluster {layout.name!r}, which has {shape} "
        f"devices = {expected} ranks; launch {expected} processes ({launchers}), or fix cluster.devices_per_node or "
        f"the clusters' `nodes`"
    )


def check_placement(layout: Topology, reports: Sequence[RankReport]) -> bool:
    """Check the launcher's nodes against the config's; True when one host plays every node (emulated placement).

    Otherwise every rank's (node rank, local rank) must be its config place, and where the config names hosts,
    each launcher node must run on the host the config puts there.
    """
    if (message := launch_mismatch(layout, len(reports))) is not None:
        raise TopologyError(message)
    if len(layout.nodes) > 1 and len({report.node_rank for report in reports}) == 1:  # the launcher saw one node
        return True
    for report in reports:
        place = layout.ranks[report.rank]
        if (place.node, place.local_device) != (report.node_rank, report.local_rank):
            raise TopologyError(
                f"rank {report.rank} is node {report.node_rank} / local {report.local_rank} for the launcher but "
                f"node {place.node} / local {place.local_device} in cluster {layout.name!r}; launch nodes in the "
                f"config's order with cluster.devices_per_node processes each"
            )
    check_node_order(layout, reports)
    return False


def check_node_order(layout: Topology, reports: Sequence[RankReport]) -> None:
    """Where the config names hosts, each launcher node must run on the host named at its index.

    torchrun's c10d rendezvous numbers hosts in the order they join, so node 0 may well be the config's node 2. One
    host playing every node (holmes-launch) has nothing to check.
    """
    groups = {group.name: group for group in layout.spec.clusters}
    named = {node.index: node.name.lower() for node in layout.nodes if groups[node.cluster].hostnames}
    hosts = {report.node_rank: report.host for report in reports}
    if not named or len({host[0] for host in hosts.values()}) == 1:
        return
    where = []
    for index, name in named.items():
        if _is_host(name, hosts[index]):
            continue
        found = next((i for i, other in named.items() if _is_host(other, hosts[index])), None)
        is_at = f"config node {found}" if found is not None else "a host the config does not name"
        where.append(f"launcher node {index} runs on {hosts[index][0]!r} ({is_at}), where the config has {name!r}")
    if where:
        raise TopologyError(
            f"the launcher's node order differs from cluster {layout.name!r}: {'; '.join(where)}. torchrun's c10d "
            f"rendezvous numbers hosts in the order they join: start each host with `torchrun --node-rank=<its "
            f"index in the config> --master-addr=<node 0's host>` (static rendezvous), or list `hostnames` in "
            f"launch order"
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
