"""Executes a Plan inside Lightning: the cluster environment, process groups, pipeline stages and FSDP2 shards.

Importing it registers `Trainer(strategy="holmes")`.
"""

from holmes_lightning.runtime.environment import NICGroupingEnvironment
from holmes_lightning.runtime.strategy import HolmesStrategy

__all__ = ["HolmesStrategy", "NICGroupingEnvironment"]
