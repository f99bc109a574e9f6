"""Clusters on different sites: one pipeline across them (Holmes), or DiLoCo (a replica per site, the replicas'
parameters averaged every H inner steps by an outer optimizer), predicted side by side.

A site is a cluster, or clusters joined by fast links. Each distinct speed of the links between clusters cuts the
topology into sites, the groups its faster links join (`site_groupings`), so k clusters give at most k - 1 ways to
see them as two or more sites. Under DiLoCo each site trains its own replica, planned by Holmes on the site's machines
with a share of the global batch in proportion to its compute (`site_batches`), so the sites together take the
same samples per inner step as the pipeline. The sites run H inner steps in lockstep (the slowest site sets the pace),
then all-reduce their pseudo-gradients (the change of every parameter, `outer_bits` per value; 8 and 4 bits are
all-gathered instead, sums of quantised values not being quantised values) in a ring over the sites, as fast as its
slowest link (a pair of sites talks over the fastest link between their clusters). Streaming
(the parameters in fragments, each all-reduced while the next `overlap_steps` inner steps run) hides what those
steps last; without it, the all-reduce adds to the H steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from holmes_lightning.planner.choice import PlanError, best_plan
from holmes_lightning.planner.cost import MachineCosts
from holmes_lightning.planner.options import BatchSettings, PartitionRule, PlanOptions, check_fields
from holmes_lightning.planner.plan_types import Plan
from holmes_lightning.planner.profile import ModelProfile
from holmes_lightning.topology import ConfigEnum, Topology
from holmes_lightning.topology.topology import Link

Grouping = tuple[tuple[str, ...], ...]  # sites, each its clusters' names in config order


class CrossSite(ConfigEnum):
    """Across clusters on different sites: one pipeline, DiLoCo (a replica per site), or the faster by prediction
    (DiLoCo only with `diloco.allowed=true`)."""

    pipeline = "pipeline"
    diloco = "diloco"
    auto = "auto"


QUANT_BLOCK = 128  # values per scale when pseudo-gradients are sent in 8 or 4 bits


@dataclass(frozen=True)
class DiLoCoSettings:
    """`sync_every`: inner steps between outer steps (H); `outer_bits`: bits per value of the pseudo-gradients sent
    (32: DiLoCo; 16 bf16; 8 and 4: Streaming DiLoCo's, quantised per block of `QUANT_BLOCK` values); `streaming`: the
    parameters go in `fragments` synchronised in turn, each all-reduce overlapping the next `overlap_steps` inner steps
    (else the sites wait for it); `outer_lr`, `outer_momentum`: the outer Nesterov SGD's (the DiLoCo paper's 0.7 and
    0.9)."""

    sync_every: int = 500
    outer_bits: int = 32
    streaming: bool = True
    fragments: int = 1
    overlap_steps: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def __post_init__(self) -> None:
        check_fields(
            self,
            {
                "sync_every": (lambda n: n >= 1, "use at least 1 inner step per outer step"),
                "outer_bits": (lambda bits: bits in (4, 8, 16, 32), "use 32, 16, 8 or 4"),
                "fragments": (lambda n: 1 <= n <= self.sync_every, "use 1 to sync_every fragments"),
                "overlap_steps": (
                    lambda n: not self.streaming or 1 <= n * self.fragments < max(self.sync_every, 2),
                    "use 1 or more, below sync_every / fragments: a fragment's all-reduce ends before its next starts",
                ),
                "outer_lr": (lambda lr: lr > 0, "must be > 0 (the DiLoCo paper: 0.7)"),
                "outer_momentum": (lambda m: 0 <= m < 1, "must be in [0, 1) (the DiLoCo paper: 0.9)"),
            },
        )

    def exposed_s(self, sync_s: float, inner_step_s: float) -> float:
        """Seconds per outer cycle (`sync_every` inner steps) the sites wait for a full all-reduce of `sync_s`: all of
        it, or streamed, what of each fragment's share its `overlap_steps` inner steps do not hide."""
        if not self.streaming:
            return sync_s
        return self.fragments * max(sync_s / self.fragments - self.overlap_steps * inner_step_s, 0.0)


@dataclass(frozen=True)
class DiLoCoPrediction:
    """DiLoCo over one grouping: each site's plan and batch share; per inner step of the slowest site
    (`inner_step_s`), the outer all-reduce (`outer_sync_s`, once per `sync_every` steps) and what of it the inner
    steps do not hide (`exposed_sync_s`); `tokens_per_s` over the whole job."""

    sites: Grouping
    plans: tuple[Plan, ...]
    batches: tuple[int, ...]
    inner_step_s: float
    outer_sync_s: float
    exposed_sync_s: float
    sync_every: int
    tokens_per_s: float
    link: Link

    @property
    def label(self) -> str:
        return grouping_label(self.sites)


def grouping_label(grouping: Grouping) -> str:
    """`A+B | C`: the sites, each its clusters."""
    return " | ".join("+".join(site) for site in grouping)


def site_topology(topology: Topology, site: Sequence[str]) -> Topology:
    """The machines of one site (its clusters' nodes) as a cluster config of its own."""
    return topology.keeping([node.name for node in topology.nodes if node.cluster in site])


def find_grouping(topology: Topology, sites: str | None = None) -> Grouping:
    """The grouping written `sites` (`A+B | C`, spaces optional; None: the fewest sites, cut only at the slowest links
    between clusters). Raises PlanError naming the groupings there are."""
    groupings = site_groupings(topology)
    labels = ", ".join(repr(grouping_label(g)) for g in groupings) or "none: the clusters are one site"
    if not groupings:
        raise PlanError(f"cluster {topology.name!r} is one site (one cluster, or links all alike); groupings: {labels}")
    if sites is None:
        return groupings[0]
    wanted = {frozenset(site.split("+")) for site in sites.replace(" ", "").split("|")}
    for grouping in groupings:
        if {frozenset(site) for site in grouping} == wanted:
            return grouping
    raise PlanError(f"sites={sites!r} is not a way the links of cluster {topology.name!r} cut it; use one of {labels}")


def cluster_link(topology: Topology, a: str, b: str) -> Link:
    """The link between clusters `a` and `b` (TCP, as traffic between sites runs)."""
    return topology.cluster_link(a, b, rdma=False)


def site_groupings(topology: Topology) -> list[Grouping]:
    """Every way the links between clusters cut the topology into two or more sites, fewest sites first: for each
    distinct link speed, the groups of clusters the links faster than it join."""
    names = [cluster.name for cluster in topology.spec.clusters]
    speeds = sorted({cluster_link(topology, a, b).gbps for i, a in enumerate(names) for b in names[i + 1 :]})
    groupings: list[Grouping] = []
    for speed in speeds:
        grouping = _joined(topology, names, speed)
        if len(grouping) > 1 and grouping not in groupings:
            groupings.append(grouping)
    return groupings


def _joined(topology: Topology, names: Sequence[str], slower_than: float) -> Grouping:
    """The groups of clusters joined (directly or through others) by links faster than `slower_than` Gb/s."""
    site_of = {name: name for name in names}

    def root(name: str) -> str:
        while site_of[name] != name:
            name = site_of[name]
        return name

    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if cluster_link(topology, a, b).gbps > slower_than:
                site_of[root(b)] = root(a)
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(root(name), []).append(name)
    return tuple(tuple(group) for group in groups.values())


def site_batches(topology: Topology, grouping: Grouping, global_batch: int) -> tuple[int, ...]:
    """The global batch shared over the sites in proportion to their compute (devices x TFLOPS), largest remainders
    first; each site at least one sample."""
    if global_batch < len(grouping):
        raise PlanError(f"global_batch={global_batch} is fewer samples than the {len(grouping)} sites {grouping}")
    capacity = [
        sum(topology.device_tflops(rank.rank) for rank in topology.ranks if rank.cluster in site) for site in grouping
    ]
    exact = [global_batch * share / sum(capacity) for share in capacity]
    batches = [max(int(value), 1) for value in exact]
    by_remainder = sorted(range(len(grouping)), key=lambda i: batches[i] - exact[i])
    for i in by_remainder[: global_batch - sum(batches)]:
        batches[i] += 1
    while sum(batches) > global_batch:  # sites raised to one sample: take it back where most over the exact share
        batches[max((i for i in range(len(batches)) if batches[i] > 1), key=lambda i: batches[i] - exact[i])] -= 1
    return tuple(batches)


def outer_sync_s(topology: Topology, grouping: Grouping, parameters: float, outer_bits: int) -> tuple[float, Link]:
    """Seconds of one exchange of the pseudo-gradients in a ring over the sites (config order), and its slowest link:
    an all-reduce, each site sending and receiving 2 (n - 1) / n of them; quantised (8 or 4 bits, one fp32 scale per
    `QUANT_BLOCK` values), an all-gather, each site receiving every other site's."""
    n = len(grouping)
    hops = [(grouping[i], grouping[(i + 1) % n]) for i in range(n if n > 2 else 1)]
    links = [
        max((cluster_link(topology, a, b) for a in first for b in second), key=lambda link: link.gbps)
        for first, second in hops
    ]
    slowest = min(links, key=lambda link: link.gbps)
    if outer_bits < 16:
        return (n - 1) * parameters * (outer_bits / 8 + 4 / QUANT_BLOCK) / slowest.bytes_per_s, slowest
    return 2 * (n - 1) / n * parameters * outer_bits / 8 / slowest.bytes_per_s, slowest


def predict_diloco(
    topology: Topology,
    profile: ModelProfile,
    batch: BatchSettings,
    grouping: Grouping,
    *,
    parameters: float,
    settings: DiLoCoSettings,
    options: PlanOptions | None = None,
    costs: MachineCosts | None = None,
) -> DiLoCoPrediction:
    """DiLoCo over `grouping`: each site planned by Holmes on its machines and batch share; `parameters`: how many
    values of the model train (what each outer step all-reduces: frozen ones never change). Raises PlanError naming a
    site that cannot plan."""
    options = options or PlanOptions()
    batches = site_batches(topology, grouping, batch.global_batch)
    plans = []
    for site, samples in zip(grouping, batches, strict=True):
        try:
            plans.append(
                best_plan(site_topology(topology, site), profile, BatchSettings(samples), options=options, costs=costs)
            )
        except PlanError as error:
            raise PlanError(f"site {'+'.join(site)} ({samples} samples per step): {error}") from error
    inner = max(plan.prediction.total_s for plan in plans)
    sync, link = outer_sync_s(topology, grouping, parameters, settings.outer_bits)
    exposed = settings.exposed_s(sync, inner)
    step = inner + exposed / settings.sync_every
    return DiLoCoPrediction(
        sites=grouping,
        plans=tuple(plans),
        batches=batches,
        inner_step_s=inner,
        outer_sync_s=sync,
        exposed_sync_s=exposed,
        sync_every=settings.sync_every,
        tokens_per_s=batch.global_batch * profile.tokens_per_sample / step,
        link=link,
    )


OUTER_STATE = 2.0  # DiLoCo's outer parameters and their momenta: two more copies per parameter byte


def diloco_options(options: PlanOptions) -> PlanOptions:
    """A site's plan options under DiLoCo: its memory also holds the outer parameters and momenta."""
    return replace(options, state_multiplier=options.state_multiplier + OUTER_STATE)


def site_options(options: PlanOptions) -> PlanOptions:
    """The user's plan options for one site where they were given for the whole job: less what describes the whole
    job (pp, dp, an explicit partition), which the planner then chooses per site; DiLoCo's memory counted."""
    partition = options.partition if isinstance(options.partition, PartitionRule) else PartitionRule.auto
    return diloco_options(replace(options, pp=None, dp=None, partition=partition))


def compare_cross_site(
    topology: Topology,
    profile: ModelProfile,
    batch: BatchSettings,
    *,
    parameters: float,
    settings: DiLoCoSettings,
    options: PlanOptions | None = None,
    costs: MachineCosts | None = None,
) -> tuple[list[DiLoCoPrediction], list[str]]:
    """DiLoCo over every grouping of the clusters into sites, and why any could not be planned. Each site is planned
    with the user's options less what describes the whole job (pp, dp, an explicit partition: the planner chooses)."""
    per_site = site_options(options or PlanOptions())
    predictions, problems = [], []
    for grouping in site_groupings(topology):
        try:
            predictions.append(
                predict_diloco(
                    topology,
                    profile,
                    batch,
                    grouping,
                    parameters=parameters,
                    settings=settings,
                    options=per_site,
                    costs=costs,
                )
            )
        except PlanError as error:
            problems.append(f"{grouping_label(grouping)}: {str(error).splitlines()[-1]}")
    return predictions, problems
