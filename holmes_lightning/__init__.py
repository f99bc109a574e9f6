"""holmes-lightning: LLM training across GPU clusters with mixed NICs, as a Lightning strategy.

`HolmesStrategy`, `NICGroupingEnvironment` and `init_layers` load on first use, so the pure-Python planner and
topology stay importable without torch.distributed or Lightning. Importing this package registers
`Trainer(strategy="holmes")` in Lightning's StrategyRegistry, when Lightning's strategies load (or at once if they
have): `HolmesStrategy()` on the cluster `$HOLMES_CLUSTER` names (a shipped config or a YAML path), else on the
launched nodes with their NIC kinds detected.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

__version__ = "0.1.0"
__all__ = ["HolmesStrategy", "NICGroupingEnvironment", "__version__", "init_layers"]
LAZY = {
    "HolmesStrategy": "holmes_lightning.runtime",
    "NICGroupingEnvironment": "holmes_lightning.runtime",
    "init_layers": "holmes_lightning.runtime.materialize",
}
CLUSTER_ENV = "HOLMES_CLUSTER"  # the cluster `Trainer(strategy="holmes")` runs on
REGISTRY_MODULE = "lightning.pytorch.strategies"


def __getattr__(name: str) -> Any:
    if name in LAZY:
        return getattr(importlib.import_module(LAZY[name]), name)
    raise AttributeError(f"module 'holmes_lightning' has no attribute {name!r}")


def registered_strategy(**settings: Any) -> Any:
    """What `Trainer(strategy="holmes")` builds: HolmesStrategy on `$HOLMES_CLUSTER`, or on the launched nodes."""
    from holmes_lightning.runtime import HolmesStrategy

    return HolmesStrategy(os.environ.get(CLUSTER_ENV) or None, **settings)


def _register(strategies: ModuleType) -> None:
    strategies.StrategyRegistry.register(
        "holmes",
        registered_strategy,
        description="Holmes: pipeline stages over NIC groups, FSDP2 inside each stage (cluster: $HOLMES_CLUSTER)",
        override=True,
    )


class _RegisterOnLoad(importlib.abc.MetaPathFinder):
    """Registers `strategy="holmes"` right after Lightning's strategies module runs (importing Lightning here would
    cost every planner user seconds)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _register(module)

        spec.loader.exec_module = exec_module
        return spec


if REGISTRY_MODULE in sys.modules:
    _register(sys.modules[REGISTRY_MODULE])
elif not any(isinstance(finder, _RegisterOnLoad) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterOnLoad())
