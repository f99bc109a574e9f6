"""Measure the bandwidth of every link class: `python -m holmes_lightning.cli.probe cluster=two_cluster_mixed`.

From a shell it starts one process per rank in the lab (`lab=emulate`, the default; `lab=loopback` skips it); started
by torchrun/SLURM on a real cluster (RANK is set) it measures that cluster's network. Every pair of nodes is timed
over gloo send/recv and a raw TCP socket, on both the nodes' Ethernet and fabric addresses (HOLMES_NODE_ADDRESS /
HOLMES_FABRIC_ADDRESS), one pair at a time. Rank 0 prints measured vs configured per link class and, with
`probe.out=FILE.json`, writes the gloo figures in real Gb/s (lab Mb/s / bandwidth_scale) under the keys
`Topology.link` reads from `cluster.measured=FILE.json`. `probe.plot=FILE.png` draws the same table.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from holmes_lightning.cli.config import ConfigError, LabConfig, register_configs
from holmes_lightning.cli.launch import start_ranks
from holmes_lightning.lab.bandwidth import gloo_bytes_per_s, pair_group, socket_bytes_per_s
from holmes_lightning.lab.design import format_scale
from holmes_lightning.lab.run import LAB_BANDWIDTH_SCALE_ENV
from holmes_lightning.launch.shutdown import skip_exit_collections
from holmes_lightning.runtime.environment import FABRIC_ADDRESS_ENV, NODE_ADDRESS_ENV
from holmes_lightning.topology import ClusterSpec, Topology, config_dir


@dataclass
class ProbeOptions:
    """out: JSON for cluster.measured; plot: PNG; seconds: length of one timing at the configured rate."""

    out: str | None = None
    plot: str | None = None
    seconds: float = 0.4
    max_megabytes: float = 256.0

    def __post_init__(self) -> None:
        for name in ("seconds", "max_megabytes"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"probe.{name}={getattr(self, name)!r}: must be > 0")


@dataclass
class ProbeConfig:
    defaults: list[Any] = field(
        default_factory=lambda: ["_self_", {"cluster": "two_cluster_mixed"}, {"lab": "emulate"}]
    )
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    lab: LabConfig = field(default_factory=LabConfig)
    probe: ProbeOptions = field(default_factory=ProbeOptions)


@dataclass(frozen=True)
class Pair:
    """One timing: sender -> receiver over their `via` addresses, expected to be `link_class` at `gbps`."""

    index: int
    link_class: str
    gbps: float
    sender: int
    receiver: int
    via: str


@dataclass(frozen=True)
class Result:
    pair: Pair
    gloo_mbit: float
    socket_mbit: float


def load_config(overrides: list[str]) -> ProbeConfig:
    register_configs()
    ConfigStore.instance().store(name="holmes_probe", node=ProbeConfig)
    with initialize_config_dir(version_base=None, config_dir=str(config_dir())):
        return OmegaConf.to_object(compose("holmes_probe", overrides=overrides))


def plan_pairs(topology: Topology, fabric_nodes: set[int]) -> list[Pair]:
    """Every node pair over Ethernet, over the fabric where both have a fabric address, and one intra-node pair."""
    pairs: list[tuple[str, float, int, int, str]] = []
    for i, node in enumerate(topology.nodes):
        if len(node.ranks) > 1:
            a, b = node.ranks[:2]
            pairs.append((topology.link_class(a, b).key, topology.link(a, b).gbps, a, b, "loopback"))
        for peer in topology.nodes[i + 1 :]:
            a, b = node.ranks[0], peer.ranks[0]
            pairs.append((topology.link_class(a, b, False).key, topology.link(a, b, False).gbps, a, b, "ethernet"))
            if {node.index, peer.index} <= fabric_nodes:
                pairs.append((topology.link_class(a, b).key, topology.link(a, b).gbps, a, b, "fabric"))
    return [Pair(index, *pair) for index, pair in enumerate(pairs)]


def _own_addresses() -> dict[str, str | None]:
    """This rank's addresses: the lab's (or the user's) variables, else the interface that reaches MASTER_ADDR."""
    ethernet = os.environ.get(NODE_ADDRESS_ENV)
    if not ethernet:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), 9))
            ethernet = udp.getsockname()[0]
    return {"ethernet": ethernet, "fabric": os.environ.get(FABRIC_ADDRESS_ENV) or None, "loopback": "127.0.0.1"}


def _nbytes(gbps: float, scale: float, options: ProbeOptions) -> int:
    return int(min(max(gbps * 1e9 / 8 * scale * options.seconds, 256 * 1024), options.max_megabytes * 1e6))


def measure(config: ProbeConfig, topology: Topology) -> int:
    """The rank side: time every pair in turn; rank 0 reports."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    topology.check_world_size(dist.get_world_size())
    scale = float(os.environ.get(LAB_BANDWIDTH_SCALE_ENV, "1"))
    addresses: list[dict[str, str | None]] = [{}] * dist.get_world_size()
    dist.all_gather_object(addresses, _own_addresses())
    fabric_nodes = {topology.ranks[r].node for r, found in enumerate(addresses) if found["fabric"]}
    pairs = plan_pairs(topology, fabric_nodes)
    results = []
    for pair in pairs:
        own = addresses[rank][pair.via]
        link = topology.link(pair.sender, pair.receiver, rdma=pair.via != "ethernet").kind
        group = pair_group(pair.sender, pair.receiver, link, own)
        if rank in (pair.sender, pair.receiver):
            nbytes = _nbytes(pair.gbps, scale, config.probe)
            peer = addresses[pair.receiver if rank == pair.sender else pair.sender][pair.via]
            gloo = gloo_bytes_per_s(group, pair.sender, pair.receiver, nbytes)
            raw = socket_bytes_per_s(rank == pair.sender, own, peer, nbytes, f"probe/{pair.index}")
            dist.destroy_process_group(group)
            if rank == pair.receiver:
                result = Result(pair, gloo * 8 / 1e6, raw * 8 / 1e6)
                results.append(result)
                print(_progress(topology, result, len(pairs), scale), flush=True)
        dist.barrier()
    gathered: list[list[Result]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        report([r for part in gathered for r in part], topology, scale, config.probe)
    dist.destroy_process_group()
    return 0


def _progress(topology: Topology, result: Result, total: int, scale: float) -> str:
    pair = result.pair
    sender, receiver = topology.node_of(pair.sender).name, topology.node_of(pair.receiver).name
    return (
        f"probe {pair.index + 1}/{total}: {sender} -> {receiver} via {pair.via} ({pair.link_class}): "
        f"gloo {result.gloo_mbit:.4g} Mb/s, tcp {result.socket_mbit:.4g} Mb/s, "
        f"configured {pair.gbps * 1000 * scale:.4g} Mb/s"
    )


@dataclass(frozen=True)
class ClassSummary:
    """One row of the report: a link class at one configured speed, medians over its pairs (lab Mb/s)."""

    link_class: str
    gbps: float
    lab_mbit: float
    gloo_mbit: float
    socket_mbit: float
    worst_ratio: float
    pairs: int


def summarize(results: list[Result], scale: float) -> list[ClassSummary]:
    rows: dict[tuple[str, float], list[Result]] = {}
    for result in results:
        rows.setdefault((result.pair.link_class, result.pair.gbps), []).append(result)
    summaries = []
    for (link_class, gbps), group in rows.items():
        lab = gbps * 1000 * scale
        worst = min(min(r.gloo_mbit, r.socket_mbit) / lab for r in group)
        gloo = statistics.median(r.gloo_mbit for r in group)
        sock = statistics.median(r.socket_mbit for r in group)
        summaries.append(ClassSummary(link_class, gbps, lab, gloo, sock, worst, len(group)))
    return summaries


def measured_links(summaries: list[ClassSummary], scale: float) -> dict[str, float]:
    """Real Gb/s per link class from gloo; a class seen at several speeds keeps its fastest (its own) row."""
    links: dict[str, ClassSummary] = {}
    for row in summaries:
        if row.link_class not in links or row.gbps > links[row.link_class].gbps:
            links[row.link_class] = row
    return {key: row.gloo_mbit / 1000 / scale for key, row in links.items()}


def report(results: list[Result], topology: Topology, scale: float, options: ProbeOptions) -> None:
    summaries = summarize(results, scale)
    where = "lab" if LAB_BANDWIDTH_SCALE_ENV in os.environ else "no lab"
    lines = [
        f"holmes probe: {topology.name}, {where}, bandwidth_scale={format_scale(scale)}; medians over pairs, "
        f"ratio = measured / configured",
        f"  {'link class':<15}{'configured':>11}{'lab rate':>12}{'gloo':>12}{'ratio':>7}{'raw TCP':>12}{'ratio':>7}"
        f"{'worst':>7}{'pairs':>6}{'measured':>12}",
    ]
    for row in summaries:
        note = "  (loopback, unshaped)" if row.link_class == "intra_node" and where == "lab" else ""
        lines.append(
            f"  {row.link_class:<15}{row.gbps:>6g} Gb/s{row.lab_mbit:>7.4g} Mb/s{row.gloo_mbit:>7.4g} Mb/s"
            f"{row.gloo_mbit / row.lab_mbit:>7.2f}{row.socket_mbit:>7.4g} Mb/s{row.socket_mbit / row.lab_mbit:>7.2f}"
            f"{row.worst_ratio:>7.2f}{row.pairs:>6}{row.gloo_mbit / 1000 / scale:>7.4g} Gb/s{note}"
        )
    print("\n".join(lines), flush=True)
    links = measured_links(summaries, scale)
    if options.out:
        configured = {row.link_class: row.gbps for row in summaries}
        data = {"links": links, "configured": configured, "bandwidth_scale": scale, "cluster": topology.name}
        data["raw_tcp"] = {row.link_class: row.socket_mbit / 1000 / scale for row in summaries}
        Path(options.out).write_text(json.dumps(data, indent=2) + "\n")
        print(f"holmes probe: wrote {options.out} (use it with cluster.measured={options.out})", flush=True)
    if options.plot:
        plot(summaries, scale, topology.name, options.plot)


def plot(summaries: list[ClassSummary], scale: float, title: str, path: str) -> None:
    """Grouped bars per link class: configured, gloo and raw TCP, in real Gb/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{row.link_class}\n{row.gbps:g} Gb/s" for row in summaries]
    series = {
        "configured": [row.gbps for row in summaries],
        "gloo send/recv": [row.gloo_mbit / 1000 / scale for row in summaries],
        "raw TCP": [row.socket_mbit / 1000 / scale for row in summaries],
    }
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(summaries), 3.6))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + (i - 1) * width for x in range(len(summaries))], values, width, label=name)
    ax.set_xticks(range(len(summaries)), labels)
    ax.set_ylabel("Gb/s (real units)")
    ax.set_title(f"{title}: measured vs configured, bandwidth_scale={format_scale(scale)}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"holmes probe: wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    skip_exit_collections()
    try:
        config = load_config(overrides)
        topology = Topology(config.cluster)
    except Exception as err:  # Hydra and the schema raise several types; each names the key and the value
        print(f"holmes probe: {err}", file=sys.stderr)
        return 2
    if "RANK" in os.environ:
        return measure(config, topology)
    command = [sys.executable, "-m", "holmes_lightning.cli.probe", *overrides]
    return start_ranks(command, topology, config.lab)


if __name__ == "__main__":
    raise SystemExit(main())
