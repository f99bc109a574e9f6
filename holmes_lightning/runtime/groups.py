"""Process groups and the ("pp", "dp") DeviceMesh of a Plan, each group on the link kind the Plan gives it.

A group whose ranks share one RDMA fabric (one cluster, InfiniBand or RoCE) talks over it: NCCL's "IB" net, or a gloo
device bound to the node's fabric address. Any other group spanning nodes goes over TCP: NCCL's "Socket" net, or gloo
bound to the node's Ethernet address. Without addresses (outside the lab) gloo uses its default device.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from holmes_lightning.planner import Plan
from holmes_lightning.runtime.environment import NICGroupingEnvironment
from holmes_lightning.topology import LinkKind

BOUND_GLOO = "holmes_gloo"
MESH_DIMS = ("pp", "dp")


@dataclass(frozen=True)
class Transport:
    """How one group's ranks talk: `link` is its slowest hop, `address` the gloo listener (None: default)."""

    link: LinkKind
    address: str | None

    @property
    def nccl_net(self) -> str | None:
        """NCCL's network plugin for the group: its RDMA fabric, TCP sockets, or NCCL's choice inside one node."""
        return {LinkKind.RDMA: "IB", LinkKind.TCP: "Socket"}.get(self.link)


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


def new_group(ranks: tuple[int, ...], backend: str, transport: Transport, timeout: timedelta) -> dist.ProcessGroup:
    """A process group of `ranks` in the given order (group rank = position), on `transport`. Collective call."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        if transport.nccl_net is not None:
            options.config.net_name = transport.nccl_net
        return dist.new_group(list(ranks), timeout=timeout, backend="nccl", pg_options=options, sort_ranks=False)
    if transport.address is None:
        return dist.new_group(list(ranks), timeout=timeout, backend=backend, sort_ranks=False)
    _register_bound_gloo()
    return dist.new_group(
        list(ranks), timeout=timeout, backend=BOUND_GLOO, pg_options=transport.address, sort_ranks=False
    )


@dataclass(frozen=True)
class PlanMesh:
    """This rank's place in the plan: the 2-D mesh, its stage and its index inside the stage's DP group."""

    mesh: DeviceMesh
    stage: int
    dp_index: int
    dp_transport: Transport
    pp_transport: Transport

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh["pp"].get_group()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp"].get_group()


def build_mesh(
    plan: Plan, *, environment: NICGroupingEnvironment, device_type: str, backend: str, timeout: timedelta
) -> PlanMesh:
    """Create every stage's DP group and every DP column's pipeline group (all ranks, same order), then the mesh."""
    stage, dp_index = plan.coordinate(dist.get_rank())
    layout = plan.mesh_layout()
    rows = [tuple(row) for row in layout]
    columns = [tuple(row[d] for row in layout) for d in range(plan.dp)]
    dp_transports = [group_transport(s.dp_link, environment) for s in plan.stages]
    pp_transports = [group_transport(link, environment) for link in plan.pp_links]
    dp_groups = [new_group(row, backend, t, timeout) for row, t in zip(rows, dp_transports, strict=True)]
    pp_groups = [new_group(column, backend, t, timeout) for column, t in zip(columns, pp_transports, strict=True)]
    mesh = DeviceMesh.from_group(
        [pp_groups[dp_index], dp_groups[stage]], device_type, mesh=torch.tensor(layout), mesh_dim_names=MESH_DIMS
    )
    return PlanMesh(mesh, stage, dp_index, dp_transports[stage], pp_transports[dp_index])
