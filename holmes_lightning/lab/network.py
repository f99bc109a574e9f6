"""Build and remove the lab's network with `ip` and `tc`; everything lives in namespaces the lab created.

Per node: a namespace with `lo` and `eth0`, a veth whose other end is a port of the bridge `br0` in the bridge namespace
(`br0` holds `STORE_ADDRESS`, where a DiLoCo job's store listens). `eth0` holds the node's Ethernet address
(10.213.1.x/24) and, on RDMA nodes, its fabric address (10.213.2.x/24): the kernel picks the source address from the
destination's subnet, so a connection to a fabric address runs fabric-to-fabric in both directions. HTB on `eth0`'s
egress shapes by destination address; each class queues at most `QUEUE_FRAMES` frames or `QUEUE_S` at its rate, like a
switch port's buffer (veth's default queue of 1000 jumbo frames holds over a second at lab rates: a collective's
messages then wait behind its own data, and all-reduces varied by +-10%; with 8 frames, a link busy both ways dropped
10% of its packets, where RDMA fabrics are lossless and a lost frame costs TCP a retransmission timeout). TCP packets
under `CONTROL_BYTES` (ACKs, gloo's rendezvous notices) leave by an unshaped class instead: behind a data class's queue,
the ACKs of the opposite direction's flow waited tens of ms at lab rates, where a real link's wait is microseconds, and
a link busy both ways (a pipeline's activations one way, gradients the other) ran at half its rate each way.
Nothing is ever created in, or changed of, the host's own network namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from holmes_lightning.lab.design import FABRIC_NET, STORE_ADDRESS, EgressClass, LabNetwork, LabNode

MTU = 9000  # jumbo frames, as RDMA fabrics and data-centre Ethernet use: headers cost 0.7%, not 4%
QUEUE_FRAMES, QUEUE_S = 48, 0.010
CONTROL_CLASS, CONTROL_MBIT, CONTROL_BYTES = "1:2", 2000, 128  # IP packets under CONTROL_BYTES: ACKs, not data
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts
DEVICE = "eth0"


class LabUnavailable(RuntimeError):
    """This machine cannot host the lab (no root, no iproute2, no network namespaces)."""


class LabError(RuntimeError):
    """An `ip`/`tc` command of the lab failed; the message has the command and its error."""


def unavailable_reason() -> str | None:
    """Why the lab cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "it needs root for network namespaces and tc"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} (iproute2) not found"
    return None


def _run(argv: list[str], commands: Iterable[str] | None = None) -> str:
    """Run one command, or a batch (`-batch -` reads one command per line)."""
    stdin = "\n".join(commands) + "\n" if commands is not None else None
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if result.returncode != 0:
        batch = f" with\n{stdin}" if stdin else ""
        raise LabError(f"`{' '.join(argv)}`{batch} failed: {result.stderr.strip()}")
    return result.stdout


def list_namespaces() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _add_namespace(name: str) -> None:
    try:
        _run(["ip", "netns", "add", name])
    except LabError as err:
        raise LabUnavailable(f"cannot create network namespace {name}: {err}") from err


def _egress_commands(egress: tuple[EgressClass, ...]) -> list[str]:
    commands = [
        f"qdisc add dev {DEVICE} root handle 1: htb",
        # small TCP packets (ACKs) skip the shaped classes: see the module's docstring
        f"class add dev {DEVICE} parent 1: classid {CONTROL_CLASS} htb rate {CONTROL_MBIT}mbit ceil {CONTROL_MBIT}mbit",
        f"filter add dev {DEVICE} parent 1: protocol ip prio 1 u32 match ip protocol 6 0xff "
        f"match u16 0x0000 0x{0x10000 - CONTROL_BYTES:04x} at 2 flowid {CONTROL_CLASS}",
    ]
    for i, shaped in enumerate(egress):
        classid = f"1:{10 + i:x}"
        rate = f"{shaped.lab_mbit * 1e6:.0f}bit"
        burst = max(2 * MTU, int(shaped.lab_mbit * 1e6 / 8 / 1000))  # 1 ms at rate, at least two frames
        commands.append(
            f"class add dev {DEVICE} parent 1: classid {classid} htb rate {rate} ceil {rate} "
            f"burst {burst} cburst {burst} quantum 60000"
        )
        queue = max(QUEUE_FRAMES * MTU, int(shaped.lab_mbit * 1e6 / 8 * QUEUE_S))
        commands.append(f"qdisc add dev {DEVICE} parent {classid} handle {20 + i:x}: bfifo limit {queue}")
        commands.extend(
            f"filter add dev {DEVICE} parent 1: protocol ip prio 2 u32 match ip dst {address}/32 flowid {classid}"
            for address in shaped.destinations
        )
    return commands


def _hosts_file(network: LabNetwork) -> str:
    """Node names resolve to lab addresses inside the lab (and reverse lookups answer at once, without DNS)."""
    lines = [f"127.0.0.1 localhost {socket.gethostname()}", "::1 localhost"]
    for node in network.nodes:
        for address, name in ((node.ethernet, node.name), (node.fabric, f"{node.name}-fabric")):
            if address:  # also as IPv4-mapped IPv6, the form c10d's store server looks up
                lines.extend([f"{address} {name}", f"::ffff:{address} {name}"])
    return "\n".join(lines) + "\n"


def _node_commands(node: LabNode) -> list[str]:
    commands = [
        "link set lo up",
        # one frame per packet: a GSO super-packet (up to 64 KB) would leave HTB in one go, too coarse at a few Mb/s
        f"link set dev {DEVICE} mtu {MTU} gso_max_segs 1",
        f"address add {node.ethernet}/24 dev {DEVICE}",
    ]
    if node.fabric:
        commands.append(f"address add {node.fabric}/24 dev {DEVICE}")
    commands.append(f"link set {DEVICE} up")
    if not node.fabric:  # no RDMA NIC: other nodes' fabric addresses are reached from the Ethernet address
        commands.append(f"route add {FABRIC_NET}.0/24 dev {DEVICE} src {node.ethernet}")
    return commands


def build_network(network: LabNetwork) -> None:
    """Create the namespaces, veths, bridge, addresses and egress shaping of `plan` (remove with `remove_namespaces`).

    Raises LabUnavailable when the first namespace cannot be created, LabError when a later step fails.
    """
    _add_namespace(network.bridge)
    bridge = [
        "link set lo up",
        "link add br0 type bridge forward_delay 0 stp_state 0",
        "link set br0 up",
        f"address add {STORE_ADDRESS}/24 dev br0",
    ]
    for node in network.nodes:
        _add_namespace(node.namespace)
        port = f"n{node.index}"
        bridge.append(f"link add {port} mtu {MTU} type veth peer name {DEVICE} netns {node.namespace}")
        bridge.extend([f"link set {port} master br0", f"link set {port} up"])
    _run(["ip", "-n", network.bridge, "-batch", "-"], bridge)
    hosts = _hosts_file(network)
    for node in network.nodes:
        _run(["ip", "-n", node.namespace, "-batch", "-"], _node_commands(node))
        _run(["tc", "-n", node.namespace, "-batch", "-"], _egress_commands(node.egress))
        (NETNS_ETC / node.namespace).mkdir(parents=True, exist_ok=True)
        (NETNS_ETC / node.namespace / "hosts").write_text(hosts)


def _namespace_pids(name: str) -> list[int]:
    try:
        return [int(pid) for pid in _run(["ip", "netns", "pids", name]).split()]
    except LabError:
        return []


def _stop_processes(pids: list[int], grace_s: float) -> None:
    """SIGTERM, then SIGKILL what outlives the grace period: only processes inside the lab's own namespaces."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            pids = [pid for pid in pids if Path(f"/proc/{pid}").exists() and not _is_zombie(pid)]
            time.sleep(0.05)
        if not pids:
            return


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def remove_namespaces(names: Iterable[str], grace_s: float = 3.0) -> list[str]:
    """Stop the processes inside, then delete each namespace and its /etc/netns folder; returns what was removed."""
    existing = set(list_namespaces())
    removed = []
    for name in names:
        if name in existing:
            _stop_processes(_namespace_pids(name), grace_s)
            _run(["ip", "netns", "delete", name])
            removed.append(name)
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    return removed
