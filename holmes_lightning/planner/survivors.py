"""Which of the nodes present train, after some were lost: all of them when a plan of all holds the model, else the
most that one does (nodes of a cluster are alike, so only how many of each cluster's nodes sit out matters)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from holmes_lightning.planner.choice import PlanError
from holmes_lightning.planner.plan_types import Plan
from holmes_lightning.topology import Topology

MAX_TRIED = 200  # node counts planned at most before giving up


def plan_on_most_nodes(topology: Topology, plan: Callable[[Topology], Plan]) -> tuple[Topology, Plan]:
    """The nodes to train on and their plan (`plan(nodes)`, which raises PlanError when none holds the model): every
    node if that plans, else the most nodes that do, the plan predicting the most tokens/s among as many nodes;
    the last nodes of a cluster sit out first. Raises the PlanError of all nodes when no subset plans."""
    try:
        return topology, plan(topology)
    except PlanError as everyone:
        refusal = everyone
    per_cluster = {group.name: group.nodes for group in topology.spec.clusters}
    best: tuple[float, Topology, Plan] | None = None
    for kept in itertools.islice(_fewer_nodes(tuple(per_cluster.values())), MAX_TRIED - 1):
        if best is not None and sum(kept) < len(best[1].nodes):
            break
        fewer = topology.without(_sitting_out(topology, dict(zip(per_cluster, kept, strict=True))))
        try:
            chosen = plan(fewer)
        except PlanError:
            continue
        if best is None or chosen.prediction.tokens_per_s > best[0]:
            best = (chosen.prediction.tokens_per_s, fewer, chosen)
    if best is None:
        raise refusal
    return best[1], best[2]


def _fewer_nodes(sizes: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Nodes kept per cluster of `sizes` nodes, one node sitting out, then two, ... (never none kept), generated as
    needed: thousands of nodes have too many ways to list."""
    for out in range(1, sum(sizes)):
        yield from _taking(out, sizes)


def _taking(out: int, sizes: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every way to take `out` nodes from clusters of `sizes` nodes, as the nodes each keeps (the first cluster's
    fewest first)."""
    if not sizes:
        if out == 0:
            yield ()
        return
    first, rest = sizes[0], sizes[1:]
    for taken in range(min(first, out), -1, -1):
        for kept in _taking(out - taken, rest):
            yield (first - taken, *kept)


def _sitting_out(topology: Topology, kept: dict[str, int]) -> list[str]:
    """Names of each cluster's nodes past the first `kept[cluster]`."""
    out = []
    for cluster, keep in kept.items():
        out += [node.name for node in topology.nodes if node.cluster == cluster][keep:]
    return out
