"""What a saved picture shows, read from its pixels: how many separate blocks of one colour, and how many pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.colors import to_rgb
from PIL import Image


def _mask(png: Path, colour: str | tuple[float, ...]) -> np.ndarray:
    """Pixels of exactly `colour` (anti-aliased edges blend with their neighbours and do not count)."""
    pixels = np.asarray(Image.open(png).convert("RGB")).astype(int)
    return (pixels == np.round(np.array(to_rgb(colour)) * 255).astype(int)).all(axis=2)


def colour_blocks(png: Path, colour: str | tuple[float, ...]) -> int:
    """Separate (4-connected) areas of exactly `colour`: bars, squares, legend handles."""
    todo = set(zip(*np.nonzero(_mask(png, colour)), strict=True))
    blocks = 0
    while todo:
        blocks += 1
        area = [todo.pop()]
        while area:
            y, x = area.pop()
            for pixel in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if pixel in todo:
                    todo.remove(pixel)
                    area.append(pixel)
    return blocks


def colour_pixels(png: Path, colour: str | tuple[float, ...]) -> int:
    return int(_mask(png, colour).sum())
