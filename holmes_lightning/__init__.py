"""holmes-lightning: LLM training across GPU clusters with mixed NICs, as a Lightning strategy.

`HolmesStrategy`, `NICGroupingEnvironment` and `init_layers` load on first use (importing them registers
`strategy="holmes"`), so the pure-Python planner and topology stay importable without torch.distributed or Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["HolmesStrategy", "NICGroupingEnvironment", "__version__", "init_layers"]
LAZY = {
    "HolmesStrategy": "holmes_lightning.runtime",
    "NICGroupingEnvironment": "holmes_lightning.runtime",
    "init_layers": "holmes_lightning.runtime.materialize",
}


def __getattr__(name: str) -> Any:
    if name in LAZY:
        return getattr(importlib.import_module(LAZY[name]), name)
    raise AttributeError(f"module 'holmes_lightning' has no attribute {name!r}")
