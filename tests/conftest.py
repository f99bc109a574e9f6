"""Fixtures shared by the test modules."""

from __future__ import annotations

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
