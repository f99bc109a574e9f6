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


def parallelize_on_one_rank(chosen: Sharding, *, fsdp_on_one_rank: bool) -> nn.Module:
    """A three-layer chunk parallelized by the plan for one device with sharding `chosen`."""
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
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
        sync = sharding.parallelize(
            root, layers=layers, mesh=mesh, plan=one_rank, mp_policy=policy, fsdp_on_one_rank=fsdp_on_one_rank
        )
    finally:
        dist.destroy_process_group()
    assert sync is None
    return root


@pytest.mark.parametrize("chosen", [Sharding.fsdp, Sharding.none])
def test_a_group_of_one_rank_keeps_plain_modules_whatever_the_sharding(chosen):
    """FSDP2 or replicate on one rank would add hooks and DTensor optimizer steps for nothing to shard or sync."""
    root = parallelize_on_one_rank(chosen, fsdp_on_one_rank=False)
    assert not any(isinstance(module, FSDPModule) for module in root.modules())
    assert not any(isinstance(param, DTensor) for param in root.parameters())


def test_fsdp_on_one_rank_shards_every_layer_and_the_root_when_the_plan_shards():
    """The gpu_check's forced path: FSDP2 (hooks, DTensor parameters, the policy) as on many ranks; replicas stay
    plain modules (the flag is about FSDP only)."""
    root = parallelize_on_one_rank(Sharding.fsdp, fsdp_on_one_rank=True)
    wrapped = [type(module).__name__ for module in root.modules() if isinstance(module, FSDPModule)]
    assert wrapped == ["FSDPSequential", "FSDPLinear", "FSDPTanh", "FSDPLinear"]
    assert all(isinstance(param, DTensor) for param in root.parameters())
    replicas = parallelize_on_one_rank(Sharding.none, fsdp_on_one_rank=True)
    assert not any(isinstance(module, FSDPModule) for module in replicas.modules())
