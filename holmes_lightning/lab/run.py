"""`run_in_lab`: start a job's ranks inside an emulated network of its Topology, and always take the network down."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from holmes_lightning.lab.design import (
    STORE_ADDRESS,
    LabNetwork,
    describe,
    design_network,
    emulated_topology,
    format_scale,
)
from holmes_lightning.lab.network import DEVICE, LabUnavailable, build_network, remove_namespaces, unavailable_reason
from holmes_lightning.lab.scale import default_bandwidth_scale
from holmes_lightning.launch.processes import JobEnd, launch_job
from holmes_lightning.runtime.environment import FABRIC_ADDRESS_ENV, NODE_ADDRESS_ENV
from holmes_lightning.topology import Topology

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # Ctrl-C already raises KeyboardInterrupt
LAB_BANDWIDTH_SCALE_ENV = "HOLMES_LAB_BANDWIDTH_SCALE"  # the scale the lab runs every link at (the probe reads it)


def node_env(network: LabNetwork, node: int) -> dict[str, str]:
    """What a rank on `node` needs: its two addresses, gloo's default device on eth0, and the scale in use."""
    lab_node = network.nodes[node]
    return {
        NODE_ADDRESS_ENV: lab_node.ethernet,
        FABRIC_ADDRESS_ENV: lab_node.fabric or "",  # empty: no RDMA NIC, the environment falls back to the node's
        "GLOO_SOCKET_IFNAME": DEVICE,  # the world group listens on the Ethernet address (eth0's first)
        LAB_BANDWIDTH_SCALE_ENV: repr(network.bandwidth_scale),
    }


@contextmanager
def _torn_down(network: LabNetwork) -> Iterator[None]:
    """SIGTERM/SIGHUP end the run like Ctrl-C does; on any exit the namespaces go, stop signals held back meanwhile."""

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, stop) for sig in EXIT_SIGNALS} if in_main_thread else {}
    try:
        yield
    finally:
        if in_main_thread:
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, *EXIT_SIGNALS))
        try:
            remove_namespaces(network.namespaces)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
            if in_main_thread:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def run_in_lab(
    topology: Topology,
    command: Sequence[str],
    bandwidth_scale: float | None = None,
    sites: Sequence[Sequence[str]] | None = None,
    may_lose: int = 0,
) -> JobEnd:
    """Run `command` once per rank, each node's ranks inside that node's namespace; returns how the job ended.

    `bandwidth_scale` maps real link speeds to lab speeds (None: chosen from this CPU, see `lab.scale`). `sites`:
    each site a job of its own (`launch_job`; their store in the bridge's namespace, at `STORE_ADDRESS`), of which
    `may_lose` may be lost while the others go on. Without root or network namespaces the job runs on plain loopback
    instead, after a one-line notice.
    """
    reason = unavailable_reason()
    if reason is None:
        chosen = bandwidth_scale is not None
        scale, why = (bandwidth_scale, "lab.bandwidth_scale") if chosen else default_bandwidth_scale(topology)
        network = design_network(topology, scale)
        try:
            with _torn_down(network):
                build_network(network)
                print(
                    f"holmes lab: {len(network.nodes)} nodes of {topology.name!r} in namespaces "
                    f"{network.bridge[:-2]}*, "
                    f"bandwidth_scale={format_scale(scale)} ({why})\n{describe(network)}",
                    flush=True,
                )
                return launch_job(
                    command,
                    emulated_topology(topology, scale),
                    master_addr=network.nodes[0].ethernet,
                    node_prefix=lambda node: ["ip", "netns", "exec", network.nodes[node].namespace],
                    node_env=lambda node: node_env(network, node),
                    sites=sites,
                    node_address=lambda node: network.nodes[node].ethernet,
                    store_at=(STORE_ADDRESS, ["ip", "netns", "exec", network.bridge]),
                    may_lose=may_lose,
                )
        except LabUnavailable as err:
            reason = str(err)
    print(f"holmes lab: unavailable ({reason}); running on plain loopback, links not shaped", file=sys.stderr)
    return launch_job(command, topology, sites=sites, may_lose=may_lose)
