"""The store where a DiLoCo job's sites meet, hosted apart from every site so that losing one leaves it standing.

`python -m holmes_lightning.launch.store_server HOST PORT` hosts a TCPStore until its standard input closes; each
line `lost SITE` read meanwhile adds the site to `LOST_SITES_KEY`, which the surviving sites' ranks read to re-form
their outer groups without it. Our launcher starts it (`OuterStore`); a job started another way may run it on any
machine that stays up, set `HOLMES_OUTER_SUPERVISED=1` on every rank, and write the lost sites the same way.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

LOST_SITES_KEY = "holmes-outer/lost"  # the sites lost so far, each followed by "|": "B|C|"
SEPARATOR = "|"


def lost_sites(value: bytes) -> list[str]:
    """The sites `LOST_SITES_KEY` names, in the order they were lost."""
    return [site for site in value.decode().split(SEPARATOR) if site]


class OuterStore:
    """The store process of one job (`prefix`: what runs it elsewhere, e.g. `ip netns exec NS`); `lose(site)` tells
    the ranks left that `site` is gone."""

    def __init__(self, host: str, port: int, prefix: Sequence[str] = ()) -> None:
        self.address = f"{host}:{port}"
        command = [*prefix, sys.executable, "-m", "holmes_lightning.launch.store_server", host, str(port)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, text=True)

    def lose(self, site: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"lost {site}\n")
        self.process.stdin.flush()

    def close(self) -> None:
        """End the store (its standard input closes), killing it if it does not end within a few seconds."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
