"""A gloo process group whose listener binds to a chosen address (`new_group`'s pg_options are ignored for gloo)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroupGloo


def address_bound_group(
    ranks: Sequence[int], address: str | None, tag: str, timeout_s: float = 120.0
) -> ProcessGroupGloo | None:
    """A group of `ranks` (a unique `tag` each) listening on this rank's `address`; None on ranks outside it.

    None as address: gloo's default device (GLOO_SOCKET_IFNAME, else the hostname). Call its collectives directly,
    e.g. `group.allreduce([tensor]).wait()`; group ranks are the positions in `sorted(ranks)`.
    """
    rank = dist.get_rank()
    if rank not in ranks:
        return None
    options = ProcessGroupGloo._Options()
    device = ProcessGroupGloo.create_device(hostname=address) if address else ProcessGroupGloo.create_default_device()
    options._devices = [device]
    options._timeout = timedelta(seconds=timeout_s)
    return ProcessGroupGloo(lab_store(tag), sorted(ranks).index(rank), len(ranks), options)


def lab_store(tag: str) -> dist.Store:
    """The job's rendezvous store under a prefix of its own."""
    return dist.PrefixStore(f"holmes-lab/{tag}", dist.distributed_c10d._get_default_store())
