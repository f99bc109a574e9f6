"""Process groups and the ("pp", "dp") DeviceMesh of a Plan, each group on the link kind the Plan gives it.

On NCCL a group whose ranks share one RDMA fabric (one cluster, InfiniBand or RoCE) is left to NCCL's own net choice;
any other group spanning nodes is forced onto TCP sockets (`runtime.nccl.group_net`). On gloo a group listens on the
node's fabric address, or its Ethernet address for TCP groups; without addresses (outside the lab) on gloo's default
device. Every rank creates the groups in the same order and runs a tiny collective on each right away, so that a
group whose communicator cannot be built fails at start, by name, not at the first step.

A DP column's pipeline group spans every stage, so its link is the column's slowest (TCP sockets once the column
crosses clusters or NIC kinds). Activations between two neighbouring stages of one fabric take a group of those two
ranks on that fabric instead (`hop_groups`), as the cost model times them: only the hops that cross travel on TCP.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import holmes_lightning.runtime.nccl as nccl
from holmes_lightning.planner import Plan
from holmes_lightning.runtime.environment import NICGroupingEnvironment
from holmes_lightning.topology import LinkKind, Topology

BOUND_GLOO = "holmes_gloo"
PROBE_TIMEOUT = timedelta(minutes=5)  # a group that cannot connect fails at start by this, not the job's timeout
MESH_DIMS = ("pp", "dp")


@dataclass(frozen=True)
class Transport:
    """How one group's ranks talk: `link` is its slowest hop, `address` the gloo listener (None: default)."""

    link: LinkKind
    address: str | None


@dataclass(frozen=True)
class GroupSpec:
    """One process group of a plan: its name (in logs and errors), ranks in group order, and slowest link."""

    name: str
    ranks: tuple[int, ...]
    link: LinkKind


def plan_groups(plan: Plan) -> tuple[list[GroupSpec], list[GroupSpec]]:
    """Every stage's DP group, then every DP column's pipeline group: the order every rank creates them in."""
    layout = plan.mesh_layout()
    dp_groups = [GroupSpec(f"dp{s.index}", tuple(layout[s.index]), s.dp_link) for s in plan.stages]
    pp_groups = [
        GroupSpec(f"pp{d}", tuple(row[d] for row in layout), link)
        for d, link in zip(range(plan.dp), plan.pp_links, strict=True)
    ]
    return dp_groups, pp_groups


def hop_groups(plan: Plan, topology: Topology) -> list[GroupSpec]:
    """Per DP column, each pair of ranks that pass activations (neighbouring stages; the last and the first too when
    stages hold several chunks) whose own link differs from the column's pipeline group's: a group of the two."""
    layout = plan.mesh_layout()
    pairs = [(s, s + 1) for s in range(plan.pp - 1)]
    if plan.num_virtual_stages > plan.pp and plan.pp > 2:
        pairs.append((plan.pp - 1, 0))
    specs = []
    for d, column_link in zip(range(plan.dp), plan.pp_links, strict=True):
        for a, b in pairs:
            ranks = (layout[a][d], layout[b][d])
            link = topology.link(*ranks, rdma=plan.rdma).kind
            if link is not column_link:
                specs.append(GroupSpec(f"pp{d}:{a}-{b}", ranks, link))
    return specs


def group_transport(link: LinkKind, environment: NICGroupingEnvironment) -> Transport:
    """A group on `link` listens on the node's Ethernet address for TCP, on its fabric address otherwise."""
    return Transport(link, environment.node_address if link is LinkKind.TCP else environment.fabric_address)


def _create_bound_gloo(options: dist.distributed_c10d._DistributedBackendOptions, hostname: str) -> dist.Backend:
    """A ProcessGroupGloo listening on `hostname` (new_group's pg_options reach only custom backends like this one)."""
    gloo_options = dist.ProcessGroupGloo._Options()
    gloo_options._timeout = options.timeout
    gloo_options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    return dist.ProcessGroupGloo(options.store, options.group_rank, options.group_size, gloo_options)


def _register_bound_gloo() -> None:
    if BOUND_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(BOUND_GLOO, _create_bound_gloo, extended_api=True, devices=["cpu"])


def nccl_options(link: LinkKind) -> dist.ProcessGroupNCCL.Options:
    """An NCCL group's options when its slowest hop is `link`: TCP sockets across fabrics, else NCCL's own net."""
    options = dist.ProcessGroupNCCL.Options()
    net = nccl.group_net(link, os.environ)
    if net is not None:
        options.config.net_name = net
    return options


def nccl_world(environment: NICGroupingEnvironment, device: torch.device) -> dict[str, Any]:
    """What the default NCCL group is made with (`init_process_group`'s arguments), this process's NCCL environment
    set first (NCCL reads it once; each node's first rank prints what it set). The default group runs on sockets
    unless the config puts every node on one fabric: it carries only small messages."""
    rendezvous = (environment.main_address, environment.main_port)
    settings = nccl.set_up_process(environment.spec, environment.node_rank(), environment.node_address, rendezvous)
    if environment.local_rank() == 0 and settings.notes():
        print(f"holmes: node {environment.node_rank()}: {'; '.join(settings.notes())}", flush=True)
    return {"device_id": device, "pg_options": nccl_options(nccl.world_link(environment.spec))}


def new_group(
    ranks: tuple[int, ...], backend: str, transport: Transport, timeout: timedelta, name: str | None = None
) -> dist.ProcessGroup:
    """A process group of `ranks` in the given order (group rank = position), on `transport`. Collective call."""
    if backend == "nccl":
        options = nccl_options(transport.link)
        return dist.new_group(
            list(ranks), timeout=timeout, backend="nccl", pg_options=options, sort_ranks=False, group_desc=name
        )
    if transport.address is None:
        return dist.new_group(list(ranks), timeout=timeout, backend=backend, sort_ranks=False, group_desc=name)
    _register_bound_gloo()
    return dist.new_group(
        list(ranks),
        timeout=timeout,
        backend=BOUND_GLOO,
        pg_options=transport.address,
        sort_ranks=False,
        group_desc=name,
    )


def connected_group(
    spec: GroupSpec,
    backend: str,
    transport: Transport,
    timeout: timedelta,
    device: torch.device,
    probe_timeout: timedelta = PROBE_TIMEOUT,
) -> dist.ProcessGroup:
    """`new_group`, then one tiny all-reduce by its members waited for at most `probe_timeout` (or the job's
    `timeout`, if shorter), so its communicator exists now or the job fails at start naming the group."""
    net = nccl.group_net(spec.link, os.environ)
    talks = backend if backend != "nccl" else f"NCCL net {net}" if net else "NCCL's own net choice"
    where = f"process group {spec.name} (ranks {list(spec.ranks)}, {spec.link.value} link, {talks})"
    try:
        group = new_group(spec.ranks, backend, transport, timeout, name=spec.name)
        if dist.get_rank() in spec.ranks:
            probe = torch.zeros(1, device=device)
            dist.all_reduce(probe, group=group, async_op=True).wait(timeout=min(timeout, probe_timeout))
            probe.item()  # the device has it too
    except Exception as error:  # NCCL and gloo raise several types; all mean this group cannot talk
        raise RuntimeError(f"{where} could not be set up: {error}") from error
    return group


@dataclass(frozen=True)
class PlanMesh:
    """This rank's place in the plan: the 2-D mesh, its stage and its index inside the stage's DP group."""

    mesh: DeviceMesh
    stage: int
    dp_index: int
    dp_transport: Transport
    pp_transport: Transport
    hop_groups: dict[int, dist.ProcessGroup]  # peer rank -> the group of this rank and that neighbour (`hop_groups`)
    tie_groups: dict[int, dist.ProcessGroup]  # tie -> the group of its copies in this rank's DP column (`tie_groups`)

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh["pp"].get_group()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp"].get_group()


def tie_groups(plan: Plan, topology: Topology, tied_stages: Sequence[tuple[int, ...]]) -> list[tuple[int, GroupSpec]]:
    """Per weight tied across stages (`tied_stages[t]`: the stages holding it, its first holder's first) and DP
    column, the group of the ranks holding its copies: (tie, group)."""
    layout = plan.mesh_layout()
    specs = []
    for tie, stages in enumerate(tied_stages):
        for d in range(plan.dp):
            ranks = tuple(layout[s][d] for s in stages)
            specs.append((tie, GroupSpec(f"tie{tie}:{d}", ranks, topology.slowest_link(ranks, rdma=plan.rdma).kind)))
    return specs


def build_mesh(
    plan: Plan,
    *,
    environment: NICGroupingEnvironment,
    device: torch.device,
    backend: str,
    timeout: timedelta,
    tied_stages: Sequence[tuple[int, ...]] = (),
) -> PlanMesh:
    """Create and connect every group of `plan_groups`, `hop_groups` and `tie_groups` (all ranks, same order), then
    the mesh. `tied_stages`: per weight tied across stages, the stages that hold it."""
    stage, dp_index = plan.coordinate(dist.get_rank())
    dp_specs, pp_specs = plan_groups(plan)
    dp_transports = [group_transport(spec.link, environment) for spec in dp_specs]
    pp_transports = [group_transport(spec.link, environment) for spec in pp_specs]
    dp_groups = [connected_group(g, backend, t, timeout, device) for g, t in zip(dp_specs, dp_transports, strict=True)]
    pp_groups = [connected_group(g, backend, t, timeout, device) for g, t in zip(pp_specs, pp_transports, strict=True)]
    rank, neighbours = dist.get_rank(), {}
    for spec in hop_groups(plan, environment.topology):
        group = connected_group(spec, backend, group_transport(spec.link, environment), timeout, device)
        if rank in spec.ranks:
            neighbours[next(peer for peer in spec.ranks if peer != rank)] = group
    ties = {}
    for tie, spec in tie_groups(plan, environment.topology, tied_stages):
        group = connected_group(spec, backend, group_transport(spec.link, environment), timeout, device)
        if rank in spec.ranks:
            ties[tie] = group
    mesh = DeviceMesh.from_group(
        [pp_groups[dp_index], dp_groups[stage]],
        device.type,
        mesh=torch.tensor(plan.mesh_layout()),
        mesh_dim_names=MESH_DIMS,
    )
    return PlanMesh(mesh, stage, dp_index, dp_transports[stage], pp_transports[dp_index], neighbours, ties)
