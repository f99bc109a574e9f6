"""Which ranks form each pipeline stage: Holmes' NIC-aware layout and the layouts it is compared with."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from holmes_lightning.planner.options import LayoutKind
from holmes_lightning.topology import Link, LinkKind, NICGroup, NICKind, Topology

MAX_GROUP_ORDERS = 720  # distinct NIC group orders searched; beyond, only those with the fastest stage boundaries


@dataclass(frozen=True)
class StageGroup:
    """The ranks of one stage in DP order, and the clusters and NIC kinds they sit on (one of each in Holmes')."""

    ranks: tuple[int, ...]
    clusters: tuple[str, ...]
    nics: tuple[NICKind, ...]


@dataclass(frozen=True)
class Layout:
    """Stages in pipeline order. `rdma=False`: every communicator runs on TCP sockets (IB and RoCE in one job)."""

    name: LayoutKind
    stages: tuple[StageGroup, ...]
    rdma: bool = True

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def dp(self) -> int:
        return len(self.stages[0].ranks)


def dp_degrees(topology: Topology) -> list[int]:
    """DP sizes every NIC group splits into evenly (each stage then holds one group or an equal slice of one)."""
    common = math.gcd(*(len(group.ranks) for group in topology.nic_groups()))
    return [d for d in range(1, common + 1) if common % d == 0]


def group_orders(topology: Topology) -> list[tuple[NICGroup, ...]]:
    """Every order of the NIC groups, once per arrangement of interchangeable groups (config order first).

    Two groups are interchangeable when they have the same size, devices per node, device speed and NIC speed, the
    same link between their own nodes (as delivered: an Ethernet and an InfiniBand group of one line rate differ) and
    the same link to every other group: swapping them changes no cost. Beyond `MAX_GROUP_ORDERS` distinct orders,
    only those whose stage boundaries are the fastest are kept.
    """
    groups = topology.nic_groups()
    classes = _interchangeable(topology, groups)
    members = {label: [g for g, c in zip(groups, classes, strict=True) if c == label] for label in classes}
    orders = []
    for shape in _distinct_permutations(classes):
        taken = dict.fromkeys(members, 0)
        order = []
        for label in shape:
            order.append(members[label][taken[label]])
            taken[label] += 1
        orders.append(tuple(order))
        if len(orders) > MAX_GROUP_ORDERS:
            return _fastest_boundaries(topology, groups)
    return orders


def _distinct_permutations(labels: list[int]) -> list[tuple[int, ...]]:
    """Each distinct ordering of `labels` once, the given order first; stops after `MAX_GROUP_ORDERS` + 1."""
    current = sorted(labels)
    result = [tuple(labels)]
    while len(result) <= MAX_GROUP_ORDERS:  # lexicographic successors of the sorted labels
        if tuple(current) != result[0]:
            result.append(tuple(current))
        i = len(current) - 2
        while i >= 0 and current[i] >= current[i + 1]:
            i -= 1
        if i < 0:
            break
        j = len(current) - 1
        while current[j] <= current[i]:
            j -= 1
        current[i], current[j] = current[j], current[i]
        current[i + 1 :] = reversed(current[i + 1 :])
    return result


def holmes_layout(order: tuple[NICGroup, ...], dp: int) -> Layout:
    """NIC groups in this order, each cut into stages of `dp` consecutive ranks."""
    return Layout(LayoutKind.holmes, tuple(stage for group in order for stage in _slices(group, dp)))


def megatron_layout(topology: Topology, pp: int, dp: int) -> Layout:
    """Megatron-LM's rank order (tp-dp-pp, tp=1) over ranks sorted by hostname: stage s = sorted ranks [s*dp, ...)."""

    def hostname_order(rank: int) -> tuple[str, int]:
        return topology.node_of(rank).name, topology.ranks[rank].local_device

    ordered = sorted(range(topology.world_size), key=hostname_order)
    stages = tuple(_group_of(topology, tuple(ordered[s * dp : (s + 1) * dp])) for s in range(pp))
    return Layout(LayoutKind.nic_unaware, stages, rdma=not mixes_rdma_kinds(topology))


def flat_layout(topology: Topology) -> Layout:
    """One sharding group over every rank, no pipeline."""
    stage = _group_of(topology, tuple(range(topology.world_size)))
    return Layout(LayoutKind.flat_fsdp, (stage,), rdma=not mixes_rdma_kinds(topology))


@dataclass(frozen=True)
class StageHardware:
    """What costs need of a layout's stages: the slowest device's TFLOPS, the DP group's link, the link to the next."""

    tflops: tuple[float, ...]
    dp_links: tuple[Link, ...]
    send_links: tuple[Link, ...]

    @classmethod
    def of(cls, topology: Topology, layout: Layout, known: dict[tuple, Any] | None = None) -> StageHardware:
        """`known`: what earlier calls on `topology` worked out per stage and boundary, kept for the next calls
        (layouts share their stages, and each takes a pass over every rank: 32,768 at the largest scale)."""
        known = {} if known is None else known

        def once(key: tuple, work: Callable[[], Any]) -> Any:
            if key not in known:
                known[key] = work()
            return known[key]

        stages, rdma = layout.stages, layout.rdma
        following = stages[1:] + stages[:1]  # the last stage sends to the first (interleaved schedules)
        return cls(
            tflops=tuple(
                once(("tflops", s), lambda s=s: min(topology.device_tflops(r) for r in s.ranks)) for s in stages
            ),
            dp_links=tuple(once(("dp", s, rdma), lambda s=s: topology.slowest_link(s.ranks, rdma)) for s in stages),
            send_links=tuple(
                once(("send", a, b, rdma), lambda a=a, b=b: boundary_link(topology, a, b, rdma))
                for a, b in zip(stages, following, strict=True)
            ),
        )


def pipeline_links(topology: Topology, layout: Layout) -> tuple[LinkKind, ...]:
    """Per DP index d, the slowest link of the pipeline group of the ranks with that index (one per stage)."""
    columns = [tuple(stage.ranks[d] for stage in layout.stages) for d in range(layout.dp)]
    return tuple(topology.slowest_link(column, rdma=layout.rdma).kind for column in columns)


def mixes_rdma_kinds(topology: Topology) -> bool:
    """True when the job holds IB and RoCE nodes: a communicator over both must fall back to TCP sockets."""
    return len({node.nic for node in topology.nodes if node.nic.is_rdma}) > 1


def boundary_link(topology: Topology, sender: StageGroup, receiver: StageGroup, rdma: bool = True) -> Link:
    """The slowest of the parallel links dp rank i of one stage uses to reach dp rank i of the next."""
    per_nodes: dict[tuple[int, int], tuple[int, int]] = {}  # a link depends on the two ranks' nodes only
    for a, b in zip(sender.ranks, receiver.ranks, strict=True):
        per_nodes.setdefault((topology.ranks[a].node, topology.ranks[b].node), (a, b))
    return min((topology.link(a, b, rdma) for a, b in per_nodes.values()), key=lambda link: link.gbps)


def _slices(group: NICGroup, dp: int) -> list[StageGroup]:
    ranks = group.ranks
    return [StageGroup(ranks[i : i + dp], (group.cluster,), (group.nic,)) for i in range(0, len(ranks), dp)]


def _group_of(topology: Topology, ranks: tuple[int, ...]) -> StageGroup:
    clusters = dict.fromkeys(topology.ranks[r].cluster for r in ranks)
    nics = dict.fromkeys(topology.ranks[r].nic for r in ranks)
    return StageGroup(ranks, tuple(clusters), tuple(nics))


def _interchangeable(topology: Topology, groups: tuple[NICGroup, ...]) -> list[int]:
    """A class index per group; groups of one class have equal costs everywhere (see `group_orders`)."""

    def shape(group: NICGroup) -> tuple:
        nodes = {topology.ranks[r].node for r in group.ranks}
        per_node = sorted(len(topology.nodes[n].ranks) for n in nodes)
        inside = topology.cluster_link(group.cluster, group.cluster)  # as delivered: RDMA and TCP differ at one rate
        return len(group.ranks), tuple(per_node), topology.device_tflops(group.ranks[0]), group.gbps, inside

    def links(group: NICGroup) -> list[float]:
        return [topology.cluster_link(group.cluster, other.cluster).gbps for other in groups]

    classes: list[int] = []
    for i, group in enumerate(groups):
        same = next(
            (
                classes[j]
                for j in range(i)
                if shape(groups[j]) == shape(group)
                and all(links(groups[j])[k] == links(group)[k] for k in range(len(groups)) if k not in (i, j))
            ),
            None,
        )
        classes.append(len(set(classes)) if same is None else same)
    return classes


def _fastest_boundaries(topology: Topology, groups: tuple[NICGroup, ...]) -> list[tuple[NICGroup, ...]]:
    """Group orders whose boundaries between groups take the least time per byte (config order first), at most 24."""

    per_byte = [[1 / topology.cluster_link(a.cluster, b.cluster).bytes_per_s for b in groups] for a in groups]
    orders = list(itertools.islice(itertools.permutations(range(len(groups))), 40320))
    scores = [sum(per_byte[a][b] for a, b in itertools.pairwise(order)) for order in orders]
    best = min(scores)
    kept = [order for order, score in zip(orders, scores, strict=True) if score <= best * (1 + 1e-9)][:24]
    return [tuple(groups[i] for i in order) for order in kept]
