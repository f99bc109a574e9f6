"""Replicas' gradient buckets: every gradient once, in order, one dtype per bucket, each bucket within the limit; a
data-parallel group of one rank stays plain modules."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from holmes_lightning.measure import profile_modules
from holmes_lightning.planner import BatchSettings, PlanOptions, Sharding, best_plan
from holmes_lightning.runtime import sharding
from holmes_lightning.topology import Topology

ONE_DEVICE = {
    "name": "one_device",
    "devices_per_node": 1,
    "clusters": [{"name": "solo", "nodes": 1, "nic": {"kind": "roce", "gbps": 100}}],
}


def test_buckets_keep_order_split_by_dtype_and_respect_the_size_limit(monkeypatch):
    monkeypatch.setattr(sharding, "BUCKET_BYTES", 100)
    grads = [torch.zeros(10), torch.zeros(10, dtype=torch.bfloat16), torch.zeros(10), torch.zeros(30), torch.zeros(5)]
    buckets = list(sharding._buckets(grads))
    assert [[id(g) for g in b] for b in buckets] == [
        [id(grads[0]), id(grads[2])],  # 40 + 40 bytes; the next float32 tensor would pass 100
        [id(grads[3])],  # 120 bytes alone: a tensor larger than the limit gets a bucket of its own
        [id(grads[4])],
        [id(grads[1])],
    ]
    assert all(len({g.dtype for g in b}) == 1 for b in buckets)


@pytest.mark.parametrize("chosen", [Sharding.fsdp, Sharding.none])
def test_a_group_of_one_rank_keeps_plain_modules_whatever_the_sharding(chosen):
    """FSDP2 or replicate on one rank would add hooks and DTensor optimizer steps for nothing to shard or sync."""
    layers = [nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)]
    profile = profile_modules(layers, torch.randn(1, 3))
    one_rank = best_plan(
        Topology.from_config(ONE_DEVICE), profile, BatchSettings(4), options=PlanOptions(sharding=chosen)
    )
    assert (one_rank.pp, one_rank.dp, one_rank.sharding) == (1, 1, chosen)
    root = nn.Sequential(*layers)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        sync = sharding.parallelize(root, layers=layers, mesh=mesh, plan=one_rank, mp_policy=MixedPrecisionPolicy())
    finally:
        dist.destroy_process_group()
    assert sync is None
    assert not any(isinstance(module, FSDPModule) for module in root.modules())
    assert not any(isinstance(param, DTensor) for param in root.parameters())
