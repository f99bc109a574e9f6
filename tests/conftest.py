"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator
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
