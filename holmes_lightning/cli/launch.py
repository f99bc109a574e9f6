"""`holmes-launch cluster=NAME [lab=emulate] -- COMMAND...`: run any command as every rank of a cluster config.

One process per rank on this machine, numbered as torchrun numbers a multi-node job: each child sees torchrun's
variables (RANK, LOCAL_RANK, GROUP_RANK, ...), so Lightning's TorchElasticEnvironment picks it up exactly as on a
real cluster, plus the cluster itself (HolmesStrategy runs on it, command-line overrides included). `lab=emulate`
starts each node's ranks in the lab's emulated network (`ip netns exec NS`, see `holmes_lightning.lab`). If any rank
fails, the others are stopped and the launcher exits non-zero; SIGTERM/SIGINT are forwarded so ranks can checkpoint
before they exit. `train.py`, the bench and the probe start their ranks through `start_ranks` too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from holmes_lightning.cli.config import ConfigError, ElasticConfig, LabConfig, LabMode, error_line, register_configs
from holmes_lightning.lab.run import run_in_lab
from holmes_lightning.launch.job import RESTART_ENV
from holmes_lightning.launch.processes import JobEnd, launch_job
from holmes_lightning.launch.shutdown import skip_exit_collections
from holmes_lightning.planner.sites import find_grouping
from holmes_lightning.topology import ClusterSpec, Topology, config_dir

USAGE = (
    "usage: holmes-launch cluster=NAME [cluster.KEY=VALUE ...] [lab=emulate] [lab.bandwidth_scale=X]\n"
    "                     [elastic.max_restarts=N elastic.min_nodes=M] [sites=auto|'A+B|C'] -- COMMAND ...\n"
    "Runs COMMAND once per rank of the cluster config on this machine, numbered as torchrun numbers a multi-node job\n"
    "(RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE, MASTER_ADDR, ...). lab=emulate runs each node in the lab's emulated\n"
    "network (needs root; otherwise plain loopback, with a notice). elastic.max_restarts=N: a rank killed by a\n"
    "signal counts its node as lost and COMMAND runs again on the nodes left (resuming its checkpoint). sites=...:\n"
    "each site a job of its own, as HolmesStrategy(cross_site='diloco') runs (auto: the fewest sites); with\n"
    "elastic.max_restarts=N a lost node then stops its site and the other sites go on without it. Example:\n"
    "  holmes-launch cluster=two_cluster_mixed lab=emulate -- python recipes/train_my_model.py"
)


@dataclass
class LaunchConfig:
    """`holmes-launch`'s command line: the cluster to run (required), where its ranks run and, for DiLoCo, the sites
    each started as a job of its own."""

    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"cluster": "???"}, {"lab": "loopback"}])
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    lab: LabConfig = field(default_factory=LabConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    sites: str | None = None  # DiLoCo: each site a job of its own; "auto" (the fewest sites) or e.g. "A+B|C"


def start_ranks(
    command: Sequence[str],
    topology: Topology,
    lab: LabConfig | None = None,
    elastic: ElasticConfig | None = None,
    restart_command: Callable[[], Sequence[str]] | None = None,
    training_nodes: Callable[[Topology], Topology] | None = None,
    sites: Sequence[Sequence[str]] | None = None,
) -> int:
    """The one way our tools start a job: every rank of `topology` runs `command` on this machine, in the lab's
    emulated network when `lab.mode` is "emulate"; returns the job's exit code.

    `elastic`: when a rank dies (killed by a signal), its node counts as lost and the job starts again on the nodes
    left (`Topology.without`, which the ranks plan for), running what `restart_command()` gives then (default:
    `command`; it must resume from the last checkpoint), up to `elastic.max_restarts` times and on
    `elastic.min_nodes` nodes at least. `training_nodes(survivors)`: those of them that train (default: all; raises
    a ValueError that ends the job when none can). `sites`: each site (its clusters' names) a job of its own, as
    cross-site DiLoCo runs (`launch_job`); a lost node then stops its site only and the others go on without it,
    for up to `elastic.max_restarts` sites (one site is always left).
    """
    elastic = elastic or ElasticConfig()
    if sites is not None:  # DiLoCo: a lost node takes its site out, the others go on (never restarted)
        return _run_once(command, topology, lab, 0, sites, may_lose=elastic.max_restarts).code
    least = elastic.min_nodes or 1
    running = command
    for restart in range(elastic.max_restarts):
        ended = _run_once(running, topology, lab, restart, sites)
        if ended.code == 0 or ended.died_on is None:
            return ended.code
        lost = topology.nodes[ended.died_on].name
        left = len(topology.nodes) - 1
        if left < least:
            print(
                f"holmes: node {lost} lost; {left} nodes left, below elastic.min_nodes={least}: the job ends "
                f"(lower elastic.min_nodes to go on with fewer)",
                file=sys.stderr,
                flush=True,
            )
            return ended.code
        survivors = topology.without([lost])
        try:
            topology = training_nodes(survivors) if training_nodes else survivors
        except ValueError as err:  # PlanError: the nodes left cannot hold the model
            print(f"holmes: node {lost} lost; the job ends: {error_line(err)}", file=sys.stderr, flush=True)
            return ended.code
        idle = [node.name for node in survivors.nodes if node.name not in {n.name for n in topology.nodes}]
        sitting = f"; {idle} sit out (no plan of all {left} holds the model)" if idle else ""
        print(
            f"holmes: node {lost} lost; restart {restart + 1} of {elastic.max_restarts} on {len(topology.nodes)} of "
            f"the {left} nodes left ({topology.world_size} ranks){sitting}, re-planned, from the last checkpoint",
            flush=True,
        )
        running = restart_command() if restart_command else command
    return _run_once(running, topology, lab, elastic.max_restarts, sites).code


def _run_once(
    command: Sequence[str],
    topology: Topology,
    lab: LabConfig | None,
    restart: int = 0,
    sites: Sequence[Sequence[str]] | None = None,
    may_lose: int = 0,
) -> JobEnd:
    """One start of the job, its ranks told how many restarts came before (`job.restart_count`); `may_lose`: sites
    the job may lose (`launch_job`)."""
    previous = os.environ.get(RESTART_ENV)
    os.environ[RESTART_ENV] = str(restart)  # the ranks inherit this process's environment
    try:
        if lab is not None and lab.mode is LabMode.emulate:
            return run_in_lab(topology, command, bandwidth_scale=lab.bandwidth_scale, sites=sites, may_lose=may_lose)
        return launch_job(command, topology, sites=sites, may_lose=may_lose)
    finally:
        if previous is None:
            del os.environ[RESTART_ENV]
        else:
            os.environ[RESTART_ENV] = previous


def parse_args(argv: Sequence[str]) -> tuple[LaunchConfig, list[str]]:
    """Hydra overrides before `--`, the command after it; a bad override or cluster raises before anything starts."""
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise ConfigError("give the command to run after `--`, e.g. holmes-launch cluster=NAME -- python my_script.py")
    split = argv.index("--")
    register_configs()
    ConfigStore.instance().store(name="holmes_launch", node=LaunchConfig)
    with initialize_config_dir(version_base=None, config_dir=str(config_dir())):
        config: LaunchConfig = OmegaConf.to_object(compose("holmes_launch", overrides=list(argv[:split])))
    return config, list(argv[split + 1 :])


def main(argv: Sequence[str] | None = None) -> int:
    """`holmes-launch`: bad input gives one `error:` line and exit code 2; otherwise the job's exit code."""
    skip_exit_collections()
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    try:
        config, command = parse_args(args)
        topology = Topology.from_config(config.cluster)
        sites = (
            None if config.sites is None else find_grouping(topology, None if config.sites == "auto" else config.sites)
        )
    except (HydraException, OmegaConfBaseException, ValueError) as err:  # ConfigError, TopologyError, PlanError
        print(f"error: {error_line(err)}", file=sys.stderr, flush=True)
        return 2
    print(
        f"holmes-launch: {topology.world_size} ranks of {topology.name!r} ({config.lab.mode}): {' '.join(command)}",
        flush=True,
    )
    return start_ranks(command, topology, config.lab, config.elastic, sites=sites)


if __name__ == "__main__":
    sys.exit(main())
