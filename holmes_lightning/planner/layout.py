"""Which ranks form each pipeline stage: Holmes' NIC-aware layout and the layouts it is compared with."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from holmes_lightning.topology import Link, NICGroup, NICKind, Topology

MAX_ORDERED_GROUPS = 8  # beyond this many NIC groups, stages follow config order instead of a search
MAX_TIED_ORDERS = 24  # group orders with equally fast boundaries handed on to the cost model (config order first)


@dataclass(frozen=True)
class StageGroup:
    """The ranks of one stage in DP order, and the clusters and NIC kinds they sit on (one of each in Holmes')."""

    ranks: tuple[int, ...]
    clusters: tuple[str, ...]
    nics: tuple[NICKind, ...]


@dataclass(frozen=True)
class Layout:
    """Stages in pipeline order. `rdma=False`: every communicator runs on TCP sockets (IB and RoCE in one job)."""

    name: str
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


def holmes_layouts(topology: Topology, dp: int) -> list[Layout]:
    """NIC groups cut into stages of `dp` ranks, in every group order whose stage boundaries are the fastest."""
    groups = topology.nic_groups()
    orders = itertools.permutations(groups) if len(groups) <= MAX_ORDERED_GROUPS else [groups]
    layouts = [Layout("holmes", tuple(s for group in order for s in _slices(group, dp))) for order in orders]
    scores = [_boundary_seconds_per_byte(topology, layout) for layout in layouts]
    best = min(scores)
    tied = [layout for layout, score in zip(layouts, scores, strict=True) if score <= best * (1 + 1e-9)]
    return tied[:MAX_TIED_ORDERS]


def megatron_layout(topology: Topology, pp: int, dp: int) -> Layout:
    """Megatron-LM's rank order (tp-dp-pp, tp=1) over ranks sorted by hostname: stage s = sorted ranks [s*dp, ...)."""

    def hostname_order(rank: int) -> tuple[str, int]:
        return topology.node_of(rank).name, topology.ranks[rank].local_device

    ordered = sorted(range(topology.world_size), key=hostname_order)
    stages = tuple(_group_of(topology, tuple(ordered[s * dp : (s + 1) * dp])) for s in range(pp))
    return Layout("nic_unaware", stages, rdma=not mixes_rdma_kinds(topology))


def flat_layout(topology: Topology) -> Layout:
    """One sharding group over every rank, no pipeline."""
    stage = _group_of(topology, tuple(range(topology.world_size)))
    return Layout("flat_fsdp", (stage,), rdma=not mixes_rdma_kinds(topology))


def mixes_rdma_kinds(topology: Topology) -> bool:
    """True when the job holds IB and RoCE nodes: a communicator over both must fall back to TCP sockets."""
    return len({node.nic for node in topology.nodes if node.nic.is_rdma}) > 1


def boundary_link(topology: Topology, sender: StageGroup, receiver: StageGroup, rdma: bool = True) -> Link:
    """The slowest of the parallel links dp rank i of one stage uses to reach dp rank i of the next."""
    pairs = zip(sender.ranks, receiver.ranks, strict=True)
    return min((topology.link(a, b, rdma) for a, b in pairs), key=lambda link: link.gbps)


def _slices(group: NICGroup, dp: int) -> list[StageGroup]:
    ranks = group.ranks
    return [StageGroup(ranks[i : i + dp], (group.cluster,), (group.nic,)) for i in range(0, len(ranks), dp)]


def _group_of(topology: Topology, ranks: tuple[int, ...]) -> StageGroup:
    clusters = dict.fromkeys(topology.ranks[r].cluster for r in ranks)
    nics = dict.fromkeys(topology.ranks[r].nic for r in ranks)
    return StageGroup(ranks, tuple(clusters), tuple(nics))


def _boundary_seconds_per_byte(topology: Topology, layout: Layout) -> float:
    stages = layout.stages
    return sum(1 / boundary_link(topology, a, b).bytes_per_s for a, b in itertools.pairwise(stages))
