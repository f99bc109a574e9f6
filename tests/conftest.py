"""Fixtures shared by the test modules."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from matplotlib.figure import Figure


@pytest.fixture
def saved_figures(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    """Every matplotlib Figure saved during the test, in order; each is still written, so its file can be read."""
    figures: list[Figure] = []
    save = Figure.savefig

    def save_and_keep(figure: Figure, *args: Any, **kwargs: Any) -> None:
        figures.append(figure)
        save(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", save_and_keep)
    return figures


@pytest.fixture(autouse=True, scope="session")
def calibration_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """HolmesStrategy's calibrations go to this session's own folder (ranks inherit it), not the user's cache, and
    time each layer its few minimum rounds: the path is tested, and the numbers only by what holds for any of them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOLMES_CALIBRATION_DIR", str(tmp_path_factory.mktemp("calibration")))
        patch.setenv("HOLMES_CALIBRATION_SECONDS", "0")
        yield


@pytest.fixture(scope="module")
def train_module() -> ModuleType:
    """train.py imported, so its `cli()` runs in this process: each case costs milliseconds, not a Python start."""
    spec = importlib.util.spec_from_file_location("train", Path(__file__).resolve().parents[1] / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
