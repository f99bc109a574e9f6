"""holmes-lightning: LLM training across GPU clusters with mixed NICs, as a Lightning strategy.

`HolmesStrategy` and `NICGroupingEnvironment` load on first use (importing them registers `strategy="holmes"`), so the
pure-Python planner and topology stay importable without torch.distributed or Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["HolmesStrategy", "NICGroupingEnvironment", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("HolmesStrategy", "NICGroupingEnvironment"):
        return getattr(importlib.import_module("holmes_lightning.runtime"), name)
    raise AttributeError(f"module 'holmes_lightning' has no attribute {name!r}")
