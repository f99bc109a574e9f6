"""The lab: network network (everywhere), and with root: shaped rates, all-reduce ratio, teardown and cleanup."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pictures import colour_blocks

from holmes_lightning.cli.config import ConfigError, ModelConfig
from holmes_lightning.cli.probe import load_config, plan_pairs
from holmes_lightning.cli.probe import main as probe_main
from holmes_lightning.lab import design_network, run_in_lab
from holmes_lightning.lab.design import emulated_topology, format_scale, run_prefix
from holmes_lightning.lab.network import DEVICE, list_namespaces, unavailable_reason
from holmes_lightning.lab.scale import default_bandwidth_scale
from holmes_lightning.measure import cpu_rank_gflops
from holmes_lightning.planner import BatchSettings, ModelProfile, PlanOptions, best_plan
from holmes_lightning.runtime.environment import NICGroupingEnvironment
from holmes_lightning.runtime.groups import group_transport, new_group
from holmes_lightning.topology import Topology, TopologyError

ROOT = Path(__file__).resolve().parents[1]
SCALE = 0.001  # 200 Gb/s -> 200 Mb/s: a few MB per timing, and far below where the shared CPU limits veth traffic
TOLERANCE = 0.15
# Cluster A's 2 ranks share one InfiniBand fabric; A-node0 + B-node0 span clusters over Ethernet.
ALLREDUCE_CLUSTER = {
    "name": "lab_allreduce",
    "devices_per_node": 1,
    "inter_cluster": {"gbps": 100},
    "clusters": [
        {"name": "A", "nodes": 2, "nic": {"kind": "infiniband", "gbps": 200}},
        {"name": "B", "nodes": 1, "nic": {"kind": "roce", "gbps": 200}},
    ],
}
FABRIC_RANKS, ACROSS_RANKS = (0, 1), (0, 2)


def _lab_missing() -> str | None:
    reason = unavailable_reason()
    if reason is None and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        reason = "`ip netns` does not work here"
    return reason


LAB_MISSING = _lab_missing()
needs_lab = pytest.mark.skipif(LAB_MISSING is not None, reason=f"the lab needs root + ip netns: {LAB_MISSING}")


def _namespaces_of(pid: int) -> list[str]:
    return [name for name in list_namespaces() if name.startswith(run_prefix(pid))]


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by init whenever it gets to it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout_s} s")
        time.sleep(0.2)


# --- the network: pure data, runs anywhere --------------------------------------------------------------------------


def test_plan_gives_each_node_two_addresses_and_one_class_per_link_class():
    topology = Topology.from_config("two_cluster_mixed")
    network = design_network(topology, 1 / 500, pid=42)
    assert network.namespaces == ("holmes-42-n0", "holmes-42-n1", "holmes-42-n2", "holmes-42-n3", "holmes-42-br")
    addresses = [a for node in network.nodes for a in (node.ethernet, node.fabric)]
    assert len(set(addresses)) == 8 and all(a.startswith("10.213.") for a in addresses)
    a0, a1 = network.nodes[0], network.nodes[1]
    classes = {c.link_class: c for c in a0.egress}
    assert set(classes) == {"rdma:A", "inter_cluster"}
    assert classes["rdma:A"].destinations == (a1.fabric,)  # only a same-fabric peer's fabric address is RDMA
    # what each transport delivers of its line rate: RDMA 0.9, TCP 0.4 (`cluster.transport_efficiency`)
    assert classes["rdma:A"].lab_mbit == pytest.approx(400 * 0.9)
    assert classes["inter_cluster"].lab_mbit == pytest.approx(200 * 0.4)
    others = {a for node in network.nodes[1:] for a in (node.ethernet, node.fabric)} - {a1.fabric}
    assert set(classes["inter_cluster"].destinations) == others


def test_plan_shapes_configured_speeds_not_measured_ones():
    configured = Topology.from_config("two_cluster_mixed")
    measured = Topology(configured.spec, {"rdma:A": 1.0})
    assert design_network(measured, 1 / 500).nodes == design_network(configured, 1 / 500).nodes


def test_plan_nodes_without_rdma_have_no_fabric_address():
    topology = Topology.from_config("three_cluster")
    network = design_network(topology, 1 / 1000)
    c0 = next(node for node in network.nodes if node.name == "C-node0")
    assert c0.fabric is None
    rates = {(c.link_class, c.gbps) for c in c0.egress}
    assert rates == {("tcp:C", 25 * 0.4), ("inter_cluster", 25 * 0.4)}  # C's own 25 Gb/s NIC limits both (TCP: 0.4)


def scaled_config(topology: Topology, scale: float) -> Topology:
    """The same cluster configured with every speed x `scale` (what the lab's links measure at)."""
    spec = topology.spec
    clusters = [replace(group, nic=replace(group.nic, gbps=group.nic.gbps * scale)) for group in spec.clusters]
    intra = replace(spec.intra_node, gbps=spec.intra_node.gbps * scale)
    return Topology(replace(spec, clusters=clusters, intra_node=intra, inter_cluster=spec.inter_cluster.scaled(scale)))


UNEVEN = {  # unlisted inter-cluster pairs whose ends differ in speed, and a listed pair
    "name": "uneven",
    "devices_per_node": 2,
    "inter_cluster": {"gbps": 80, "pairs": [{"clusters": ["A", "C"], "gbps": 5}]},
    "clusters": [
        {"name": "A", "nodes": 2, "nic": {"kind": "infiniband", "gbps": 400}},
        {"name": "B", "nodes": 1, "nic": {"kind": "roce", "gbps": 50}, "device_tflops": 100},
        {"name": "C", "nodes": 1, "nic": {"kind": "ethernet", "gbps": 25}},
    ],
}


@pytest.mark.parametrize("cluster", ["two_cluster_mixed", "three_cluster", "multi_site", "single_node", UNEVEN])
def test_the_lab_tells_its_ranks_its_links_as_measured_ones_and_they_plan_for_them(cluster):
    """The ranks of a lab job get the cluster config as it is, with every link measured at its speed x the scale:
    each pair of ranks (RDMA or forced onto TCP) at that speed, and the planner's choice the one it makes for a
    config written at those speeds."""
    topology, scale = Topology.from_config(cluster), 1 / 500
    emulated, expected = emulated_topology(topology, scale), scaled_config(topology, scale)
    assert emulated.spec == topology.spec
    ranks = range(topology.world_size)
    for a, b, rdma in ((a, b, rdma) for a in ranks for b in ranks if a != b for rdma in (True, False)):
        measured, configured = emulated.link(a, b, rdma), expected.link(a, b, rdma)
        assert measured.kind is configured.kind and measured.gbps == pytest.approx(configured.gbps), (a, b, rdma)
    model = ModelProfile.from_gpt(ModelConfig(n_layers=4, d_model=256, n_heads=4, seq_len=64))
    batch = BatchSettings(8 * topology.world_size)
    for options in (PlanOptions(backend="gloo"), PlanOptions(layout="nic_unaware", partition="uniform")):
        planned, configured = (best_plan(t, model, batch, options=options) for t in (emulated, expected))
        assert [(s.ranks, s.chunks) for s in planned.stages] == [(s.ranks, s.chunks) for s in configured.stages]
        assert planned.prediction.total_s == pytest.approx(configured.prediction.total_s, rel=1e-9)


@pytest.mark.parametrize(("scale", "field"), [(0, "lab.bandwidth_scale=0"), (0.1, "lab.bandwidth_scale=0.1")])
def test_bad_scale_names_the_field_and_the_fix(scale, field):
    with pytest.raises(TopologyError, match=field) as err:
        design_network(Topology.from_config("two_cluster_mixed"), scale)
    assert "must be > 0" in str(err.value) or "use at most" in str(err.value)


def test_default_scale_matches_this_cpu_to_the_device():
    topology = Topology.from_config("two_cluster_mixed")
    scale, why = default_bandwidth_scale(topology)
    per_rank = cpu_rank_gflops(topology.world_size)
    assert 0.5 < scale * 312_000 / per_rank < 2  # a second timing on a shared CPU: same order, not same digits
    assert format_scale(scale) in why and "GFLOP/s" in why
    assert format_scale(0.002) == "1/500"


def test_probe_pairs_cover_every_link_class():
    topology = Topology.from_config("three_cluster", devices_per_node=2)
    fabric_nodes = {node.index for node in topology.nodes if node.nic.is_rdma}
    pairs = plan_pairs(topology, fabric_nodes)
    ranks = range(topology.world_size)
    classes = {topology.link_class(a, b, rdma).key for a in ranks for b in ranks for rdma in (True, False)}
    assert {pair.link_class for pair in pairs} == classes
    assert all(pair.via == "fabric" for pair in pairs if pair.link_class.startswith("rdma:"))


def test_probe_config_errors_name_the_field(capsys):
    with pytest.raises(ConfigError, match="probe.seconds=0"):
        load_config(["probe.seconds=0"])
    with pytest.raises(Exception, match="Error merging override lab.mode=emulat") as caught:
        load_config(["lab.mode=emulat"])
    assert "Invalid value 'emulat', expected one of [loopback, emulate]" in str(caught.value.__cause__)
    assert probe_main(["probe.secnds=1"]) == 2
    assert "secnds" in capsys.readouterr().err


# --- the network: needs root and ip netns ----------------------------------------------------------------------------


@needs_lab
@pytest.mark.slow
@pytest.mark.lab
def test_probe_measures_configured_rate_per_link_class(tmp_path, capfd):
    out, picture = tmp_path / "measured.json", tmp_path / "measured.png"
    overrides = ["cluster=two_cluster_mixed", f"lab.bandwidth_scale={SCALE}", "probe.seconds=0.25"]
    assert probe_main([*overrides, f"probe.out={out}", f"probe.plot={picture}"]) == 0
    output = capfd.readouterr().out
    data = json.loads(out.read_text())
    assert set(data["links"]) == {"rdma:A", "rdma:B", "inter_cluster"}
    for source in ("links", "raw_tcp"):  # gloo send/recv and a plain TCP socket
        for link_class, gbps in data[source].items():
            assert gbps == pytest.approx(data["configured"][link_class], rel=TOLERANCE), (source, link_class, output)
    for series in ("C0", "C1", "C2"):  # configured, gloo, raw TCP: one bar per link class, plus the legend's handle
        assert colour_blocks(picture, series) == len(data["configured"]) + 1, series
    measured = Topology.from_config("two_cluster_mixed", measured=str(out))
    assert measured.link(0, 1).gbps == data["links"]["rdma:A"]  # the probe writes the keys Topology reads
    assert measured.link(0, 2).gbps == data["links"]["inter_cluster"]
    assert _namespaces_of(os.getpid()) == []


def sent_bytes(topology: Topology, node: int) -> dict[str, int]:
    """Bytes each HTB class on this namespace's egress has sent so far (`tc -s class show`), by link class."""
    shown = subprocess.run(["tc", "-s", "class", "show", "dev", DEVICE], capture_output=True, text=True, check=True)
    sent = dict(re.findall(r"class htb (\S+) .*\n Sent (\d+) bytes", shown.stdout))
    egress = design_network(topology, SCALE).nodes[node].egress
    return {shaped.link_class: int(sent[f"1:{10 + i:x}"]) for i, shaped in enumerate(egress)}  # ids as network.py


def allreduce_traffic(numel: int) -> dict[str, dict[str, int]]:
    """On each rank: what its node sent per link class during an all-reduce inside fabric A and during one across
    clusters, groups bound as the runtime binds them (fabric address inside one fabric, Ethernet address otherwise)."""
    dist.init_process_group("gloo")
    topology = Topology.from_config(ALLREDUCE_CLUSTER)
    environment = NICGroupingEnvironment(topology)
    node = topology.ranks[dist.get_rank()].node
    traffic = {}
    for name, ranks in (("fabric", FABRIC_RANKS), ("across", ACROSS_RANKS)):
        transport = group_transport(topology.slowest_link(ranks).kind, environment)
        group = new_group(ranks, "gloo", transport, dist.default_pg_timeout)
        dist.barrier()
        before = sent_bytes(topology, node)
        if dist.get_rank() in ranks:
            dist.all_reduce(torch.ones(numel), group=group)
        dist.barrier()
        after = sent_bytes(topology, node)
        traffic[name] = {link_class: after[link_class] - before[link_class] for link_class in after}
    dist.destroy_process_group()
    return traffic


@needs_lab
@pytest.mark.slow
@pytest.mark.lab
def test_an_allreduce_travels_in_its_fabrics_shaped_class():
    """The fabric group's bytes leave A's nodes in the rdma:A class, the cross-cluster group's in inter_cluster.

    Rates per class are the probe's test; this one is about where the runtime's groups send (byte counters, no clock).
    """
    topology = Topology.from_config(ALLREDUCE_CLUSTER)
    numel = 250_000  # 1 MB; each rank of a pair must send the other something of every element
    with tempfile.TemporaryDirectory() as out:
        kwargs = json.dumps({"numel": numel})
        command = [sys.executable, str(ROOT / "tests" / "distributed.py"), "test_lab:allreduce_traffic", kwargs, out]
        assert run_in_lab(topology, command, bandwidth_scale=SCALE).code == 0
        results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(topology.world_size)]
    payload, chatter = 4 * numel, 4 * numel / 20  # chatter: a barrier, a rendezvous or TCP's acks, a few kB
    busy = {  # (all-reduce, rank = node: A-node0, A-node1, B-node0) -> the class that must carry it
        ("fabric", 0): "rdma:A",
        ("fabric", 1): "rdma:A",
        ("fabric", 2): None,
        ("across", 0): "inter_cluster",
        ("across", 1): None,
        ("across", 2): "inter_cluster",
    }
    for (allreduce, rank), link_class in busy.items():
        sent = results[rank][allreduce]
        assert {name for name, n in sent.items() if n > chatter} == ({link_class} if link_class else set()), sent
        assert link_class is None or sent[link_class] >= payload, sent
    assert _namespaces_of(os.getpid()) == []


@needs_lab
@pytest.mark.lab
def test_failed_job_leaves_no_namespace():
    command = [sys.executable, "-c", "import sys; sys.exit(3)"]
    assert run_in_lab(Topology.from_config("two_cluster_mixed"), command, bandwidth_scale=SCALE).code == 3
    assert _namespaces_of(os.getpid()) == []


def _start_sleeping_lab() -> tuple[subprocess.Popen, list[int]]:
    """A lab run whose ranks sleep; returns it once all its namespaces hold a rank, with the ranks' pids."""
    code = (
        "import sys; from holmes_lightning.lab import run_in_lab; from holmes_lightning.topology import Topology; "
        f"sys.exit(run_in_lab(Topology.from_config('two_cluster_mixed'), ['sleep', '120'], {SCALE}).code)"
    )
    run = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)

    def node_pids() -> list[int]:
        names = [n for n in _namespaces_of(run.pid) if not n.endswith("-br")]
        pids = [
            subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split() for n in names
        ]
        return [int(p) for group in pids for p in group] if len(names) == 4 and all(pids) else []

    _wait_for(lambda: node_pids() or run.poll() is not None, 120, "the lab's ranks to start")
    assert run.poll() is None, "the lab run ended before its ranks started"
    return run, node_pids()


@needs_lab
@pytest.mark.slow
@pytest.mark.lab
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])  # SIGHUP: the same handler as SIGTERM
def test_stop_signal_tears_the_network_down(stop):
    run, ranks = _start_sleeping_lab()
    run.send_signal(stop)
    assert run.wait(timeout=60) != 0
    assert _namespaces_of(run.pid) == []
    assert not any(_running(pid) for pid in ranks)


@needs_lab
@pytest.mark.slow
@pytest.mark.lab
def test_cleanup_removes_what_a_killed_run_left():
    run, ranks = _start_sleeping_lab()
    run.kill()
    run.wait()
    assert len(_namespaces_of(run.pid)) == 5  # SIGKILL: no teardown ran
    cleanup = subprocess.run(
        [sys.executable, "-m", "holmes_lightning.lab.cleanup"], cwd=ROOT, capture_output=True, text=True
    )
    assert cleanup.returncode == 0 and "removed" in cleanup.stdout, cleanup.stderr
    assert _namespaces_of(run.pid) == []
    assert not any(_running(pid) for pid in ranks)
    assert not list(Path("/etc/netns").glob(f"{run_prefix(run.pid)}*"))


@needs_lab
@pytest.mark.slow
@pytest.mark.lab
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare to drop privileges")
def test_without_privileges_the_job_runs_on_loopback():
    """Root inside a user namespace cannot create network namespaces: one line says so, the job still runs."""
    code = (
        "import sys; from holmes_lightning.lab import run_in_lab; from holmes_lightning.topology import Topology; "
        f"sys.exit(run_in_lab(Topology.from_config('two_cluster_mixed'), ['echo', 'rank ran'], {SCALE}).code)"
    )
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("rank ran") == 4
    notice = [line for line in result.stderr.splitlines() if line.startswith("holmes lab: unavailable")]
    assert len(notice) == 1 and "plain loopback" in notice[0]
