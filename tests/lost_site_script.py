"""One rank of a DiLoCo job over sites A and B, two ranks each holding the same weights (replicas, each sending its
half over the WAN), in which site A, the first, is lost at inner step `LOSE_AT` (both its ranks at once): each site
moves its weights its own way every inner step, an outer step (8-bit pseudo-gradients, which carry one value repeated
exactly) follows every inner step, and each rank of B saves its weights after each one to OUT/B-RANK.pt. Run by
tests/test_diloco.py under `launch_job(sites=...)`."""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from holmes_lightning.launch.processes import launched_topology
from holmes_lightning.planner.sites import DiLoCoSettings
from holmes_lightning.runtime.diloco import DiLoCo, Site, SiteLaunch

STEPS, LOSE_AT = 6, 3


def moved(site: int) -> float:
    """How far a site's inner steps move every weight per step: unlike per site, so the mean tells who took part."""
    return 0.1 * (site + 1) ** 2


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # the site's own world: its two replicas
    rank = dist.get_rank()
    site = Site.launched(launched_topology(), SiteLaunch.from_env(), None)
    site.connect(rank, 2, timedelta(seconds=60))
    torch.manual_seed(site.index)  # each site's own weights: every site starts from the first's (seed 0)
    net = torch.nn.Linear(3, 2)
    settings = DiLoCoSettings(sync_every=1, streaming=False, outer_bits=8)  # all-gathered, quantised
    diloco = DiLoCo(
        net.named_parameters(),
        site.group,
        settings,
        site_label=site.label,
        replicas=dist.group.WORLD,
        regroup=site.regroup,
    )
    after = []
    for step in range(1, STEPS + 1):
        if site.label == "A" and step == LOSE_AT:
            os.kill(os.getpid(), signal.SIGKILL)  # as a lost machine ends it
        with torch.no_grad():
            for param in net.parameters():
                param.sub_(moved(site.index))
        diloco.after_inner_step(step)
        after.append([param.detach().clone() for param in net.parameters()])
    torch.save({"after": after, "sites": diloco.sites}, out / f"{site.label}-{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
