"""Start one process per rank of a Topology on this machine and supervise them, numbered as torchrun numbers a
multi-node job: each child sees torchrun's variables (RANK, LOCAL_RANK, GROUP_RANK, ...), so Lightning's
TorchElasticEnvironment picks it up exactly as on a real cluster, plus the cluster itself. If any rank fails, the
others are stopped and `launch` returns non-zero; SIGTERM/SIGINT are forwarded so ranks can checkpoint first.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from holmes_lightning.launch.outer_store import OuterStore
from holmes_lightning.topology import Topology

LAUNCHED_ENV = "HOLMES_LAUNCHED"  # every rank of the job runs on this host (emulated nodes)
TOPOLOGY_ENV = "HOLMES_TOPOLOGY"  # the launched cluster, as `Topology.to_dict()` JSON
SITE_ENV = "HOLMES_SITE"  # cross-site DiLoCo: this rank's site, its clusters joined by "+" (its own job and world)
SITES_ENV = "HOLMES_SITES"  # cross-site DiLoCo: every site of the job, `A+B|C`
OUTER_STORE_ENV = "HOLMES_OUTER_STORE"  # HOST:PORT where the sites' ranks meet (else the first site's rank 0 hosts it)
# "1": a process apart from the sites hosts that store and names the sites lost there (`launch.outer_store`)
OUTER_SUPERVISED_ENV = "HOLMES_OUTER_SUPERVISED"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def kill_rank(rank: int, marker: str, site: str | None = None) -> bool:
    """SIGKILL the process that runs `rank` (its environment's RANK; under DiLoCo, of `site`) of the job whose command
    line holds `marker` (e.g. its output folder), as a lost machine would end it; False when no such process runs."""
    wanted = [f"RANK={rank}".encode()] + ([] if site is None else [f"{SITE_ENV}={site}".encode()])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if all(variable in environ for variable in wanted) and marker.encode() in command:
            os.kill(int(pid), signal.SIGKILL)
            return True
    return False


def rank_env(topology: Topology, rank: int, master_addr: str, master_port: int) -> dict[str, str]:
    """torchrun's variables for one rank of the topology."""
    info = topology.ranks[rank]
    node = topology.nodes[info.node]
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(info.local_device),
        "GROUP_RANK": str(info.node),
        "NODE_RANK": str(info.node),
        "WORLD_SIZE": str(topology.world_size),
        "LOCAL_WORLD_SIZE": str(len(node.ranks)),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": f"holmes-{master_port}",
        LAUNCHED_ENV: "1",
        TOPOLOGY_ENV: json.dumps(topology.to_dict()),
    }


def process_env(rank_vars: dict[str, str], extra: dict[str, str] | None = None) -> dict[str, str]:
    """A rank's whole environment: this process's, one OpenMP thread unless it sets more, the rank's variables
    (`rank_env`), then `extra`."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **rank_vars, **(extra or {})}


def launched_topology() -> Topology | None:
    """The cluster holmes-launch started this process as a rank of (None: another launcher)."""
    text = os.environ.get(TOPOLOGY_ENV)
    return Topology.from_dict(json.loads(text)) if text else None


@dataclass
class RankProcess:
    rank: int
    node: int
    popen: subprocess.Popen


@dataclass(frozen=True)
class JobEnd:
    """How a job's ranks ended: the job's exit code, and the node of a rank that died (killed by a signal nobody
    forwarded to it: the OOM killer, a lost machine; None when none did)."""

    code: int
    died_on: int | None = None


def launch(command: Sequence[str], topology: Topology, **options: Any) -> int:
    """Run `command` once per rank and wait (`launch_job`); returns 0, or the exit code of the first rank that
    failed."""
    return launch_job(command, topology, **options).code


def launch_job(
    command: Sequence[str],
    topology: Topology,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    node_prefix: Callable[[int], list[str]] | None = None,
    node_env: Callable[[int], dict[str, str]] | None = None,
    grace_s: float = 15.0,
    sites: Sequence[Sequence[str]] | None = None,
    node_address: Callable[[int], str] | None = None,
    store_at: tuple[str, Sequence[str]] | None = None,
    may_lose: int = 0,
) -> JobEnd:
    """Run `command` once per rank and wait; the code is 0, or the exit code of the first rank that failed.

    `sites` (cross-site DiLoCo, each site its clusters' names): every site is a job of its own, its ranks numbered
    from 0 and meeting at its first node (`node_address(node)`, default `master_addr`), told their site and where
    the sites meet (`SITE_ENV`, `OUTER_STORE_ENV`: an `OuterStore` process at `store_at`, its host and the prefix
    that runs it there; default `master_addr`, this machine); the whole cluster stays in `TOPOLOGY_ENV`. A rank
    killed by a signal (a lost machine) stops its site only, while fewer than `may_lose` sites were lost and one is
    left: the others go on without it (told through the store); otherwise every site stops."""
    losses = None
    if sites is None:
        port = master_port or free_port()
        envs = [rank_env(topology, rank, master_addr, port) for rank in range(topology.world_size)]
    else:
        host, prefix = store_at or (master_addr, ())
        losses = _SiteLosses(sites, topology, OuterStore(host, free_port(), prefix), may_lose)
        envs = site_rank_envs(topology, sites, node_address or (lambda _node: master_addr), losses.store.address)
    procs: list[RankProcess] = []
    try:
        for rank, rank_vars in enumerate(envs):
            node = topology.ranks[rank].node
            env = process_env(rank_vars, node_env(node) if node_env else None)
            argv = [*(node_prefix(node) if node_prefix else []), *command]
            procs.append(RankProcess(rank, node, subprocess.Popen(argv, env=env)))
        return _supervise(procs, topology, grace_s, losses)
    finally:
        _stop(procs, grace_s)
        if losses is not None:
            losses.store.close()


def site_rank_envs(
    topology: Topology, sites: Sequence[Sequence[str]], address: Callable[[int], str], store: str
) -> list[dict[str, str]]:
    """Each rank's variables (by rank of `topology`) when every site runs as a job of its own, meeting at `store`
    (HOST:PORT, hosted apart from the sites)."""
    envs: dict[int, dict[str, str]] = {}
    for site in sites:
        nodes = [node for node in topology.nodes if node.cluster in site]
        own = topology.keeping([node.name for node in nodes])
        master, port = address(nodes[0].index), free_port()
        ranks = [rank for node in nodes for rank in node.ranks]
        for local, rank in enumerate(ranks):
            envs[rank] = rank_env(own, local, master, port)
            envs[rank].update(
                {
                    TOPOLOGY_ENV: json.dumps(topology.to_dict()),
                    SITE_ENV: "+".join(site),
                    SITES_ENV: "|".join("+".join(s) for s in sites),
                    OUTER_STORE_ENV: store,
                    OUTER_SUPERVISED_ENV: "1",
                }
            )
    return [envs[rank] for rank in range(topology.world_size)]


@dataclass
class _SiteLosses:
    """Which sites a job may still lose (`may_lose` in all, one left at least) and which it lost."""

    sites: Sequence[Sequence[str]]
    topology: Topology
    store: OuterStore
    may_lose: int
    lost: list[int] = field(default_factory=list)

    def site_of(self, node: int) -> int:
        cluster = self.topology.nodes[node].cluster
        return next(i for i, site in enumerate(self.sites) if cluster in site)

    def can_lose(self, node: int) -> bool:
        return len(self.lost) < min(self.may_lose, len(self.sites) - 1) and self.site_of(node) not in self.lost

    def lose(self, node: int) -> str:
        """Count the site of `node` lost and tell the others; returns its label."""
        site = self.site_of(node)
        self.lost.append(site)
        label = "+".join(self.sites[site])
        self.store.lose(label)
        return label


def _supervise(
    procs: list[RankProcess], topology: Topology, grace_s: float, losses: _SiteLosses | None = None
) -> JobEnd:
    stopping: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        for proc in procs:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            if losses is not None:  # a lost site's ranks no longer count
                procs = [p for p in procs if losses.site_of(p.node) not in losses.lost]
            codes = [proc.popen.poll() for proc in procs]
            failures = [p for p, c in zip(procs, codes, strict=True) if c not in (None, 0)]
            # a rank killed by a signal is the likely cause when its peers then fail too (one poll sees them all)
            failed = min(failures, key=lambda p: p.popen.returncode > 0) if failures else None
            node = None if failed is None else topology.nodes[failed.node].name
            lost_machine = failed is not None and failed.popen.returncode < 0 and not stopping
            if lost_machine and losses is not None and losses.can_lose(failed.node):
                site = losses.site_of(failed.node)
                label = losses.lose(failed.node)  # the others learn it first, then its ranks stop
                print(
                    f"holmes: rank {failed.rank} on node {node} {_describe_exit(failed.popen.returncode)}; site "
                    f"{label} stops, the other sites go on without it",
                    file=sys.stderr,
                    flush=True,
                )
                _stop([p for p in procs if losses.site_of(p.node) == site], grace_s)
                continue
            if failed is not None and not stopping:
                print(
                    f"holmes: rank {failed.rank} on node {node} {_describe_exit(failed.popen.returncode)}; "
                    f"stopping the other ranks",
                    file=sys.stderr,
                    flush=True,
                )
                _stop(procs, grace_s)
                stuck = [p.rank for p in procs if p.popen.returncode == -signal.SIGKILL and p is not failed]
                if stuck:
                    print(f"holmes: ranks {stuck} ignored SIGTERM for {grace_s:g} s and were killed", file=sys.stderr)
                code = failed.popen.returncode
                return JobEnd(code, None) if code > 0 else JobEnd(128 - code, failed.node)
            if all(c is not None for c in codes):
                return JobEnd(next((c for c in codes if c != 0), 0))
            time.sleep(0.2)
    finally:
        _stop(procs, grace_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _describe_exit(code: int) -> str:
    """`exited with code 1`, or `was killed by SIGKILL` (Popen gives -N for a process ended by signal N)."""
    if code >= 0:
        return f"exited with code {code}"
    return f"was killed by {signal.Signals(-code).name if -code in {s.value for s in signal.Signals} else -code}"


def _stop(procs: list[RankProcess], grace_s: float) -> None:
    """SIGTERM the ranks still running, then SIGKILL whatever outlives the grace period."""
    alive = [p.popen for p in procs if p.popen.poll() is None]
    for popen in alive:
        popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for popen in alive:
        try:
            popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
