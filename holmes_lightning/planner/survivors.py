"""Which of the nodes present train, after some were lost: all of them when a plan of all holds the model, else the
most that one does (nodes of a cluster are alike, so only how many of each cluster's nodes sit out matters)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

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
    counts = sorted(
        itertools.product(*(range(n + 1) for n in per_cluster.values())), key=lambda kept: (-sum(kept), kept)
    )
    best: tuple[float, Topology, Plan] | None = None
    for kept in counts[1:MAX_TRIED]:  # the first keeps every node: planned above
        if best is not None and sum(kept) < len(best[1].nodes) or sum(kept) == 0:
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


def _sitting_out(topology: Topology, kept: dict[str, int]) -> list[str]:
    """Names of each cluster's nodes past the first `kept[cluster]`."""
    out = []
    for cluster, keep in kept.items():
        out += [node.name for node in topology.nodes if node.cluster == cluster][keep:]
    return out
