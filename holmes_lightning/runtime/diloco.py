"""DiLoCo's outer loop across sites: each site trains its own replica on its own plan (its own job, its own world);
every `sync_every` inner steps the sites average their pseudo-gradients (the outer parameters less this replica's)
over a gloo group of their own and take an outer step (Nesterov SGD, `torch.optim.SGD`) from the parameters they last
agreed on.

Rank i of every site holds the same shards (the sites plan alike, checked at start), so the outer all-reduce runs
between ranks of equal site-local rank, one group per rank, and never gathers a parameter. Streaming: the parameters
split into `fragments` synchronised in turn, each all-reduce running while the next `overlap_steps` inner steps do;
the fragment's parameters then become the outer result plus what those inner steps changed (where torchft's DiLoCo
with fragment_update_alpha=0 drops that progress), so a long overlap hides a slow WAN without losing steps. With 8 or
4 bits per value the pseudo-gradients are quantised per block and all-gathered, every site summing the same values.

A lost site: the launcher names it in the store the sites meet at (hosted apart from them, `launch.outer_store`); the
ranks left, whose outer collective failed, re-form their groups without it and run the syncs in flight again there.
Where some of the lost site's ranks outlive the others, the exchanges they finished meanwhile count its last
pseudo-gradients: those parameters take it in that outer step, the rest do not (every site left still agrees).

Written here rather than taken from torchft: torchft's DiLoCo needs its Manager, a lighthouse server and a quorum
per step to form its replica groups, where the sites here are fixed at launch and their groups are plain gloo ones.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import SGD

from holmes_lightning.launch.outer_store import LOST_SITES_KEY, lost_sites
from holmes_lightning.launch.processes import OUTER_STORE_ENV, OUTER_SUPERVISED_ENV, SITE_ENV, SITES_ENV
from holmes_lightning.planner.sites import (
    QUANT_BLOCK,
    CrossSite,
    DiLoCoSettings,
    Grouping,
    find_grouping,
    grouping_label,
    site_batches,
    site_topology,
)
from holmes_lightning.topology import Topology


class SiteError(ValueError):
    """A cross-site job that cannot run as launched or configured; the message says what to change."""


def runs_per_site(mode: CrossSite, env: Mapping[str, str] = os.environ) -> bool:
    """Whether a rank under `cross_site=mode` trains as one site of a DiLoCo job: `diloco`, or `auto` where the
    launcher started the sites so."""
    return mode is CrossSite.diloco or (mode is CrossSite.auto and SITE_ENV in env)


@dataclass(frozen=True)
class SiteLaunch:
    """How the launcher started this rank's site: its clusters, the sites of the job (`A+B|C`; None: the fewest the
    cluster's links cut it into) and the store every site's ranks meet at: hosted by the first site's rank 0, or
    `supervised`, by a process apart from the sites that names the sites lost there (`launch.outer_store`)."""

    clusters: tuple[str, ...]
    sites: str | None
    store_host: str
    store_port: int
    supervised: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> SiteLaunch:
        site, store = env.get(SITE_ENV), env.get(OUTER_STORE_ENV)
        if not site or not store or ":" not in store:
            raise SiteError(
                f"cross_site='diloco' runs each site as a job of its own: start it with train.py or holmes-launch "
                f"(they set {SITE_ENV} and {OUTER_STORE_ENV}), or under torchrun per site set {SITE_ENV}=CLUSTER[+...] "
                f"and {OUTER_STORE_ENV}=HOST:PORT (a free port on the first site's rank 0)"
            )
        host, port = store.rsplit(":", 1)
        return cls(tuple(site.split("+")), env.get(SITES_ENV), host, int(port), env.get(OUTER_SUPERVISED_ENV) == "1")


@dataclass
class Site:
    """This rank's site under DiLoCo: the job's sites, which one this is, its machines, its share of the global batch
    and, once connected, this site-local rank's group across the sites (those not `lost`) and the replicas of every
    site."""

    launch: SiteLaunch
    grouping: Grouping
    index: int
    topology: Topology
    batch: int | None
    group: dist.ProcessGroupGloo | None = None
    replicas: int = 0
    first_replica: int = 0
    lost: list[str] = field(default_factory=list)
    store: dist.Store | None = None
    local_rank: int = 0
    timeout: timedelta = timedelta(minutes=30)

    @classmethod
    def launched(cls, cluster: Any, launch: SiteLaunch, global_batch: int | None) -> Site:
        """The site `launch` names in `cluster` (any cluster source: a config name, a Topology, ...)."""
        whole = cluster if isinstance(cluster, Topology) else Topology.from_config(cluster)
        grouping = find_grouping(whole, launch.sites)
        index = next((i for i, site in enumerate(grouping) if set(site) == set(launch.clusters)), None)
        if index is None:
            raise SiteError(
                f"{SITE_ENV}={'+'.join(launch.clusters)}: not a site of cluster {whole.name!r} cut as "
                f"{grouping_label(grouping)}; name one of its sites"
            )
        batch = None if global_batch is None else site_batches(whole, grouping, global_batch)[index]
        return cls(launch, grouping, index, site_topology(whole, grouping[index]), batch)

    @property
    def label(self) -> str:
        return "+".join(self.grouping[self.index])

    def connect(self, local_rank: int, dp: int, timeout: timedelta) -> None:
        """Join this site-local rank's group across the sites and count every site's `dp` replicas: the data-parallel
        replicas of the whole job, and the first of this site's among them."""
        self.local_rank, self.timeout = local_rank, timeout
        self.store = outer_store(self.launch, self.index == 0 and local_rank == 0, timeout)
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore(f"holmes-outer/{local_rank}", self.store), self.index, len(self.grouping), timeout
        )
        every = [torch.zeros(1, dtype=torch.long) for _ in self.grouping]
        self.group.allgather([every], [torch.tensor([dp])]).wait()
        self.replicas = sum(int(count) for count in every)
        self.first_replica = sum(int(count) for count in every[: self.index])

    def regroup(self) -> dist.ProcessGroupGloo | None:
        """After an outer collective failed: this rank's group across the sites left, once the store names a site lost
        that was not before (None: not supervised, or none named within the timeout). Raises SiteError when this
        rank's own site is among the lost."""
        if not self.launch.supervised or self.store is None:
            return None
        deadline = time.monotonic() + self.timeout.total_seconds()
        while (lost := lost_sites(self.store.get(LOST_SITES_KEY))) == self.lost:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)
        labels = ["+".join(site) for site in self.grouping]
        if labels[self.index] in lost:
            raise SiteError(f"site {self.label} was counted lost by the job's supervisor; its ranks stop")
        self.lost = lost
        members = [i for i, label in enumerate(labels) if label not in lost]
        prefix = f"holmes-outer/{len(lost)}/{self.local_rank}"  # a group of its own per generation of losses
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix, self.store), members.index(self.index), len(members), self.timeout
        )
        return self.group


def outer_store(launch: SiteLaunch, first: bool, timeout: timedelta) -> dist.Store:
    """The store the sites meet at; `first` (the first site's rank 0) hosts it unless a supervisor does."""
    host = first and not launch.supervised
    return dist.TCPStore(launch.store_host, launch.store_port, None, host, timeout, wait_for_workers=False)


@dataclass
class _Sync:
    """One fragment's all-reduce in flight: its pseudo-gradients summed over the sites (flat, once `work` is done),
    the inner step it is applied after, this rank's own pseudo-gradients (to send again if a site is lost) and
    whether inner steps run meanwhile."""

    fragment: int
    summed: torch.Tensor
    work: dist.Work | None
    due: int
    sent: list[torch.Tensor]
    overlapped: bool
    gathered: list[torch.Tensor] = field(default_factory=list)  # quantised: every site's values, to sum once done


class DiLoCo:
    """The outer parameters and optimizer of this rank's parameters (`named`: its stage's, as the inner optimizer
    holds them), synchronised with the same rank of every other site over `group`. Every site starts from the first
    site's parameters, frozen ones too; only those that train have outer copies and syncs.

    `replicas`: the site's ranks that hold the same parameters as this one (its stage's DP group when the stage keeps
    full replicas): each then sends its share of them over the WAN, and they gather the sums over their own links.
    `regroup`: after an outer collective fails, this rank's group across the sites left (None: none, the error
    stands; `Site.regroup`); the syncs in flight then run again among them."""

    def __init__(
        self,
        named: Iterable[tuple[str, nn.Parameter]],
        group: dist.ProcessGroupGloo,
        settings: DiLoCoSettings,
        *,
        site_label: str,
        replicas: dist.ProcessGroup | None = None,
        regroup: Callable[[], dist.ProcessGroupGloo | None] | None = None,
    ) -> None:
        pairs = list(named)
        self.names, self.params = [name for name, _ in pairs], [param for _, param in pairs]
        self.group, self.settings, self.sites, self.regroup = group, settings, group.size(), regroup
        self.site_label = site_label
        self.replicas = replicas if replicas is not None and dist.get_world_size(replicas) > 1 else None
        check_alike(self.names, self.params, group, site_label)
        self._broadcast_from_first_site()
        trained = [i for i, param in enumerate(self.params) if param.requires_grad]  # the frozen ones never change
        self.names, self.params = [self.names[i] for i in trained], [self.params[i] for i in trained]
        with torch.no_grad():
            self.outer = [param.detach().clone() for param in self.params]
        self.optimizer = SGD(self.outer, lr=settings.outer_lr, momentum=settings.outer_momentum, nesterov=True)
        for outer in self.outer:  # made now so that a checkpoint holds them before the first outer step
            self.optimizer.state[outer]["momentum_buffer"] = torch.zeros_like(outer)
        self.fragments = _fragments([p.numel() for p in self.params], settings.fragments)
        self.pending: list[_Sync] = []
        self.applied = [0] * len(self.fragments)  # outer steps taken per fragment

    def _broadcast_from_first_site(self) -> None:
        """Every site starts from the first site's parameters (a resume then loads its checkpoint's); replicas each
        receive a share over the WAN and gather the rest over their own links."""
        with torch.no_grad():
            if self.replicas is None:
                for param in self.params:
                    self.group.broadcast([_local(param)]).wait()
                return
            flat = self._padded(torch.cat([_local(param).flatten() for param in self.params]))  # the widest dtype
            self.group.broadcast([self._share(flat)]).wait()
            self._gather_rows(flat)
            sizes = [_local(param).numel() for param in self.params]
            for param, values in zip(self.params, flat[: sum(sizes)].split(sizes), strict=True):
                _local(param).copy_(values.view(_local(param).shape))

    def after_inner_step(self, done: int) -> None:
        """After inner step `done` (1-based): apply the fragments whose all-reduce is due, start those whose turn
        it is (a fragment's turn: `done` at its offset within the cycle of `sync_every` steps)."""
        for sync in [s for s in self.pending if s.due <= done]:
            self._apply(sync)
        every, count = self.settings.sync_every, len(self.fragments)
        for fragment in range(count):
            if done % every == ((fragment + 1) * every // count) % every:
                self._start(fragment, done)

    def flush(self) -> None:
        """Wait for and apply every all-reduce in flight (before a checkpoint and at the end of training)."""
        for sync in list(self.pending):
            self._apply(sync)

    def _start(self, fragment: int, done: int) -> None:
        """Sum the fragment's pseudo-gradients over the sites, as one flat buffer (of `outer_bits` per value)."""
        indices = self.fragments[fragment]
        if not indices:
            return
        with torch.no_grad():
            deltas = [(_local(self.outer[i]) - _local(self.params[i])).flatten() for i in indices]
        overlap = self.settings.overlap_steps if self.settings.streaming else 0
        sync = _Sync(fragment, self._flat(deltas), None, done + overlap, deltas, overlap > 0)
        self.pending.append(sync)
        try:
            self._exchange(sync)
        except RuntimeError as error:  # a site's ranks are gone
            self._recover(error)
        if overlap == 0:
            self._apply(sync)

    def _flat(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        """The pseudo-gradients as one buffer (bf16 for `outer_bits=16`, else fp32), padded to a row per replica."""
        flat = torch.cat(deltas).to(torch.bfloat16 if self.settings.outer_bits == 16 else torch.float32)
        return flat if self.replicas is None else self._padded(flat)

    def _padded(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` padded to as many rows as replicas."""
        return torch.nn.functional.pad(flat, (0, -flat.numel() % dist.get_world_size(self.replicas)))

    def _gather_rows(self, flat: torch.Tensor) -> None:
        """Every replica's row of `flat` (`_share`) from that replica, written in place."""
        rows = list(flat.view(dist.get_world_size(self.replicas), -1))
        dist.all_gather(rows, self._share(flat).clone(), group=self.replicas)

    def _exchange(self, sync: _Sync) -> None:
        """Start summing this rank's share of the sync's buffer over the sites: an all-reduce, or with 8 or 4 bits an
        all-gather of every site's quantised values (summed once it is done, `_wait`)."""
        share, bits = self._share(sync.summed), self.settings.outer_bits
        if bits >= 16:
            sync.work = self.group.allreduce([share])
            return
        packed = quantize(share, bits)
        sync.gathered = [torch.empty_like(packed) for _ in range(self.sites)]
        sync.work = self.group.allgather([sync.gathered], [packed])

    def _wait(self, sync: _Sync) -> None:
        """Wait for the sync's exchange (if a site was lost meanwhile, for its rerun among the sites left); quantised,
        every site sums the same dequantised values in the same order, so all take the same outer step."""
        while True:
            try:
                assert sync.work is not None
                sync.work.wait()
                break
            except RuntimeError as error:
                self._recover(error)
        if sync.gathered:
            share = self._share(sync.summed)
            share.copy_(sum(dequantize(packed, self.settings.outer_bits, share.numel()) for packed in sync.gathered))

    def _recover(self, error: RuntimeError) -> None:
        """Re-form the outer group without the sites lost and run every sync in flight again there; the sites left must
        stand where this one does (the same outer steps taken and syncs in flight), else a SiteError says so."""
        group = self.regroup() if self.regroup is not None else None
        if group is None:
            raise error
        self.group, self.sites = group, group.size()
        in_flight = [0] * len(self.fragments)
        for sync in self.pending:
            in_flight[sync.fragment] += 1
        mine = torch.tensor(self.applied + in_flight)
        every = [torch.zeros_like(mine) for _ in range(group.size())]
        group.allgather([every], [mine]).wait()
        if any(not torch.equal(other, mine) for other in every):
            raise SiteError(
                f"site {self.site_label}: the sites left after a lost one stood at different outer steps (per fragment "
                f"taken, then in flight: {[o.tolist() for o in every]}); resume every site from the last checkpoint "
                f"they all saved (resume=auto)"
            )
        for sync in self.pending:
            sync.summed = self._flat(sync.sent)
            self._exchange(sync)

    def _share(self, flat: torch.Tensor) -> torch.Tensor:
        """The part of `flat` this rank sends over the WAN: all of it, or among replicas its row of `flat` (padded to
        as many rows as replicas), a view."""
        if self.replicas is None:
            return flat
        return flat.view(dist.get_world_size(self.replicas), -1)[dist.get_rank(self.replicas)]

    def _apply(self, sync: _Sync) -> None:
        """The outer step for one fragment, its averaged pseudo-gradients as the outer gradients; its parameters become
        the new outer ones plus what the inner steps since the all-reduce started changed (nothing is lost to the
        overlap: the next pseudo-gradient carries it)."""
        self._wait(sync)
        self.pending.remove(sync)
        indices = self.fragments[sync.fragment]
        with torch.no_grad():
            if self.replicas is not None:
                self._gather_rows(sync.summed)
            sizes = [_local(self.outer[i]).numel() for i in indices]
            since = (
                [  # parameters now less those the pseudo-gradients were taken from (outer - sent)
                    _local(self.params[i]).flatten() - _local(self.outer[i]).flatten() + sent
                    for i, sent in zip(indices, sync.sent, strict=True)
                ]
                if sync.overlapped
                else []
            )
            for outer in self.outer:
                outer.grad = None
            for i, summed in zip(indices, sync.summed[: sum(sizes)].split(sizes), strict=True):
                grad = torch.zeros_like(self.outer[i])
                local = _local(grad)
                local.copy_(summed.view(local.shape).to(local.dtype) / self.sites)
                self.outer[i].grad = grad
            self.optimizer.step()
            for k, i in enumerate(indices):
                self.params[i].detach().copy_(self.outer[i])
                if since:
                    _local(self.params[i]).add_(since[k].view(_local(self.params[i]).shape))
                self.outer[i].grad = None
        self.applied[sync.fragment] += 1

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The outer parameters and Nesterov momenta by parameter name (DTensors where the parameters are sharded), for
        torch.distributed.checkpoint, which loads into them in place."""
        momenta = [self.optimizer.state[outer]["momentum_buffer"] for outer in self.outer]
        return {
            "outer": dict(zip(self.names, self.outer, strict=True)),
            "momentum": dict(zip(self.names, momenta, strict=True)),
        }


def check_alike(names: list[str], params: list[torch.Tensor], group: dist.ProcessGroupGloo, site_label: str) -> None:
    """Refuse sites whose rank i holds different shards: the outer all-reduce pairs them element by element."""
    held = repr([(name, tuple(_local(p).shape), str(p.dtype)) for name, p in zip(names, params, strict=True)])
    digest = torch.tensor([int.from_bytes(hashlib.sha256(held.encode()).digest()[:7], "big")])
    every = [torch.zeros_like(digest) for _ in range(group.size())]
    group.allgather([every], [digest]).wait()
    if any(int(other) != int(digest) for other in every):
        raise SiteError(
            f"site {site_label}: its ranks hold other shards than the same ranks of another site, so their parameters "
            f"cannot be averaged element by element; DiLoCo needs every site to plan alike: give strategy.pp, "
            f"strategy.dp and strategy.partition (HolmesStrategy(pp=, dp=, partition=)) so that every site runs one "
            f"plan, on sites of as many ranks"
        )


def quantize(values: torch.Tensor, bits: int) -> torch.Tensor:
    """`values` in `bits` (8 or 4) per value, symmetric round-to-nearest per block of `QUANT_BLOCK` values scaled by
    the block's largest magnitude, as bytes: the values (4 bits: two per byte), then the blocks' fp32 scales."""
    levels = 2 ** (bits - 1) - 1
    blocks = torch.nn.functional.pad(values.float(), (0, -values.numel() % QUANT_BLOCK)).view(-1, QUANT_BLOCK)
    scales = blocks.abs().amax(dim=1, keepdim=True) / levels
    scales[scales == 0] = 1.0
    quantised = torch.round(blocks / scales).clamp_(-levels, levels).to(torch.int16) + levels  # 0 .. 2 levels
    if bits == 4:
        quantised = quantised[:, 0::2] | (quantised[:, 1::2] << 4)
    return torch.cat([quantised.to(torch.uint8).flatten(), scales.flatten().view(torch.uint8)])


def dequantize(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first `count` values `quantize` packed, in fp32."""
    levels, per_byte = 2 ** (bits - 1) - 1, 8 // bits
    blocks = -(-count // QUANT_BLOCK)
    body, scales = packed[: blocks * QUANT_BLOCK // per_byte], packed[blocks * QUANT_BLOCK // per_byte :]
    quantised = body.to(torch.int16)
    if bits == 4:
        quantised = torch.stack([quantised & 0xF, quantised >> 4], dim=1)
    values = (quantised.view(blocks, QUANT_BLOCK) - levels).float() * scales.view(torch.float32).view(blocks, 1)
    return values.flatten()[:count]


def _fragments(sizes: list[int], count: int) -> list[list[int]]:
    """The parameters (by index) in `count` runs of consecutive ones of about as many values each (a run may be empty
    where one parameter outweighs several runs)."""
    total, fragments, filled = max(sum(sizes), 1), [[] for _ in range(count)], 0
    for i, size in enumerate(sizes):
        fragments[min(count - 1, filled * count // total)].append(i)
        filled += size
    return fragments


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
