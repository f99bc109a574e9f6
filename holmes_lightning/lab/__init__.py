"""The lab: a Topology's nodes as network namespaces on this machine, links shaped to its speeds x a scale."""

from holmes_lightning.lab.design import LabNetwork, LabNode, design_network
from holmes_lightning.lab.network import LabError, LabUnavailable, build_network, remove_namespaces
from holmes_lightning.lab.run import run_in_lab

__all__ = [
    "LabError",
    "LabNode",
    "LabNetwork",
    "LabUnavailable",
    "build_network",
    "design_network",
    "remove_namespaces",
    "run_in_lab",
]
