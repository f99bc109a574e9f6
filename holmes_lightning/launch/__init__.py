"""Starting ranks: one process per rank of a Topology on this machine, numbered as torchrun numbers a multi-node job
(`processes`), and what a job learns from whoever started it (`job`)."""

from holmes_lightning.launch.processes import LAUNCHED_ENV, TOPOLOGY_ENV, free_port, launch, launched_topology, rank_env

__all__ = ["LAUNCHED_ENV", "TOPOLOGY_ENV", "free_port", "launch", "launched_topology", "rank_env"]
