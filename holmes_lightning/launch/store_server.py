"""`python -m holmes_lightning.launch.store_server HOST PORT`: the store a DiLoCo job's sites meet at
(`launch.outer_store`), hosted until standard input closes; each line `lost SITE` adds the site to `LOST_SITES_KEY`."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from holmes_lightning.launch.outer_store import LOST_SITES_KEY, SEPARATOR
from holmes_lightning.launch.shutdown import skip_exit_collections


def main(argv: Sequence[str] | None = None) -> None:
    host, port = argv or sys.argv[1:]
    skip_exit_collections()
    store = dist.TCPStore(host, int(port), None, True, timedelta(hours=24), wait_for_workers=False)
    store.set(LOST_SITES_KEY, "")
    for line in sys.stdin:
        command, _, site = line.strip().partition(" ")
        if command == "lost" and site:
            store.append(LOST_SITES_KEY, site + SEPARATOR)


if __name__ == "__main__":
    main()
