"""The default `bandwidth_scale`: slow every link by the factor this CPU is slower than the cluster's devices.

A real step's balance is device FLOP/s against link bytes/s (an A100 does 312 TFLOPS next to a 200 Gb/s NIC). A lab
rank is one CPU thread (OMP_NUM_THREADS=1) that computes `cpu / device` times slower, so scaling every link by the
same factor keeps communication vs compute where the real cluster has it: a job that is network-bound there is
network-bound here, and the gaps between layouts keep their size.
"""

from __future__ import annotations

import math

from holmes_lightning.lab.design import MAX_LAB_MBIT, format_scale
from holmes_lightning.measure import available_cores, cpu_rank_gflops
from holmes_lightning.topology import Topology


def _round_up(value: float) -> float:
    """Up to two significant digits: 8734 -> 8800."""
    step = 10.0 ** (math.floor(math.log10(value)) - 1)
    return math.ceil(value / step) * step


def fastest_link_gbps(topology: Topology) -> float:
    """The fastest link between nodes the lab shapes: a NIC or a link between clusters."""
    inter_cluster = topology.spec.inter_cluster
    return max(*(n.nic_gbps for n in topology.nodes), inter_cluster.gbps, *(pair.gbps for pair in inter_cluster.pairs))


def default_bandwidth_scale(topology: Topology) -> tuple[float, str]:
    """The scale, 1/N with N rounded up to two significant digits, and one line saying how it was chosen."""
    cores = available_cores()
    per_rank = cpu_rank_gflops(topology.world_size)
    device_tflops = max(node.device_tflops for node in topology.nodes)
    scale = 1 / _round_up(device_tflops * 1000 / per_rank)
    why = (
        f"a rank here computes {per_rank:.0f} GFLOP/s ({topology.world_size} ranks on {cores} cores), "
        f"{format_scale(scale)} of a {device_tflops:g} TFLOPS device, so links run {format_scale(scale)} as fast"
    )
    fastest = fastest_link_gbps(topology)
    if fastest * 1000 * scale > MAX_LAB_MBIT:
        scale = 1 / _round_up(fastest * 1000 / MAX_LAB_MBIT)
        why += f"; capped at {format_scale(scale)} so the fastest link stays under {MAX_LAB_MBIT:g} Mb/s"
    return scale, why
