"""The cost model's data-parallel and pipeline costs follow what the runtime does (FSDP2's reshard policy, hooks,
DTensor optimizer step, bucketed replica syncs, message latency)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from holmes_lightning.cli.config import ModelConfig
from holmes_lightning.planner import (
    Backend,
    BatchSettings,
    MachineCosts,
    ModelProfile,
    PlanError,
    PlanOptions,
    Sharding,
    best_plan,
)
from holmes_lightning.planner.cost import BUCKET_BYTES, CostModel
from holmes_lightning.topology import Topology

TOPOLOGY = Topology.from_config("two_cluster_mixed")
PROFILE = ModelProfile.from_gpt(ModelConfig(name="gpt", n_layers=4, d_model=256, n_heads=4, seq_len=64))
LINK = TOPOLOGY.slowest_link((0, 1))
BYTES, LAYERS, LATENCY = 3e8, 3, 1e-3


def cost(sharding: Sharding, backend: str = "nccl") -> CostModel:
    machine = MachineCosts(
        latency_s=LATENCY,
        fsdp_layer_s=0.002,
        fsdp_reshard_layer_s=0.005,
        fsdp_optimizer_layer_s=0.0007,
        optimizer_s_per_gb=2.0,
    )
    return CostModel(TOPOLOGY, PROFILE, machine, sharding=sharding, backend=Backend(backend))


def sync(model: CostModel, n: int = 2, *, pipelined: bool) -> float:
    return model.dp_sync_s(n, LINK, BYTES, layers=LAYERS, pipelined=pipelined)


def test_fsdp_gathers_once_in_a_pipeline_twice_without_one_and_pays_each_ring_step():
    share = BYTES / 2 / LINK.bytes_per_s  # (n-1)/n of the bytes, n = 2
    nccl, gloo = cost(Sharding.fsdp), cost(Sharding.fsdp, "gloo")
    assert sync(nccl, pipelined=True) == pytest.approx(2 * share + 2 * LAYERS * LATENCY)  # gather + reduce-scatter
    assert sync(nccl, pipelined=False) == pytest.approx(3 * share + 3 * LAYERS * LATENCY)  # gathers again for backward
    assert sync(gloo, pipelined=True) == pytest.approx(3 * share + 3 * LAYERS * LATENCY)  # its reduce is an all-reduce
    four = BYTES * 3 / 4 / LINK.bytes_per_s
    assert sync(nccl, 4, pipelined=True) == pytest.approx(2 * four + 2 * 3 * LAYERS * LATENCY)  # 3 ring steps each
    assert sync(nccl, 1, pipelined=True) == 0.0


def test_replicas_all_reduce_per_bucket_in_a_pipeline_and_per_layer_without_one():
    replicas, share = cost(Sharding.none), BYTES / 2 / LINK.bytes_per_s
    buckets = math.ceil(BYTES / BUCKET_BYTES)
    assert sync(replicas, pipelined=True) == pytest.approx(2 * share + buckets * 2 * LATENCY)
    assert sync(replicas, pipelined=False) == pytest.approx(2 * share + LAYERS * 2 * LATENCY)


@pytest.mark.parametrize("sharding", [Sharding.fsdp, Sharding.none])
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
@pytest.mark.parametrize("n", [2, 8])
def test_a_stage_s_sync_is_at_least_the_sum_of_its_parts_shares(sharding, backend, n):
    """The partition search bounds a stage's tail by its chunks' shares (`share=True`): linear in bytes and layers,
    so they add up to the sync of the whole under FSDP and to at most it for replicas (whose buckets round up)."""
    model = cost(sharding, backend)
    parts = [(0.3 * BUCKET_BYTES, 1), (2.5 * BUCKET_BYTES, 2), (0.0, 0), (7.1 * BUCKET_BYTES, 4)]
    whole = model.dp_sync_s(n, LINK, sum(b for b, _ in parts), layers=sum(k for _, k in parts), pipelined=True)
    shares = sum(model.dp_sync_s(n, LINK, b, layers=k, pipelined=True, share=True) for b, k in parts)
    assert shares == pytest.approx(whole) if sharding is Sharding.fsdp else shares <= whole * (1 + 1e-12)
    assert shares > 0.9 * whole


def test_hooks_and_the_dtensor_optimizer_cost_only_where_the_runtime_wraps_layers():
    fsdp, replicas = cost(Sharding.fsdp), cost(Sharding.none)
    assert fsdp.hook_s(1, pipelined=True) == replicas.hook_s(1, pipelined=False) == 0.0  # a group of one stays plain
    assert (fsdp.hook_s(2, pipelined=True), fsdp.hook_s(2, pipelined=False)) == (0.002, 0.005)
    assert (replicas.hook_s(2, pipelined=True), replicas.hook_s(2, pipelined=False)) == (0.0, 0.002)
    forward, backward = fsdp.microbatch_seconds(100.0, 1, dp=2, pipelined=True)
    plain_forward, plain_backward = fsdp.microbatch_seconds(100.0, 1, dp=1, pipelined=True)
    assert [f - p for f, p in zip(forward, plain_forward, strict=True)] == pytest.approx([0.002 / 3] * 6)
    assert [b - p for b, p in zip(backward, plain_backward, strict=True)] == pytest.approx([0.004 / 3] * 6)
    held = 2.0 * BYTES / 2 / 1e9
    assert fsdp.update_s(BYTES, 2, layers=LAYERS) == pytest.approx(held + LAYERS * 0.0007)
    assert replicas.update_s(BYTES, 2, layers=LAYERS, pipelined=True) == pytest.approx(2 * held)  # plain tensors
    assert replicas.update_s(BYTES, 2, layers=LAYERS, pipelined=False) == pytest.approx(2 * held + LAYERS * 0.0007)


def test_a_message_costs_its_latency_besides_its_bytes_and_a_pipelined_step_closes_with_one_all_reduce():
    nccl, gloo = cost(Sharding.fsdp), cost(Sharding.fsdp, "gloo")
    assert nccl.transfer_s(1e6, LINK) == pytest.approx(LATENCY + 1e6 / LINK.bytes_per_s)
    assert gloo.step_collective_s(4) == pytest.approx(6 * LATENCY)  # gloo's ring: 2 (n-1) messages
    assert nccl.step_collective_s(64) == pytest.approx(12 * LATENCY)  # NCCL's tree: 2 log2(n)
    options, costs = PlanOptions(pp=2, backend="gloo", sharding="none"), MachineCosts(latency_s=LATENCY)
    pipelined = best_plan(TOPOLOGY, PROFILE, BatchSettings(16), options=options, costs=costs)
    assert all(stage.closing_s == pytest.approx(6 * LATENCY) for stage in pipelined.stages)
    assert all(send == pytest.approx(LATENCY, rel=0.5) for send in pipelined.stages[0].send_s)
    measured = best_plan(TOPOLOGY, PROFILE, BatchSettings(16), options=options, costs=replace(costs, closing_s=0.004))
    assert [stage.closing_s for stage in measured.stages] == [0.004, 0.004]  # measured at job start: as it is


def test_without_a_pipeline_a_step_is_one_pass_over_the_replica_batch():
    flat = best_plan(
        TOPOLOGY,
        PROFILE,
        BatchSettings(16),
        options=PlanOptions(layout="flat_fsdp"),
        costs=MachineCosts(layer_overhead_s=0.0),
    )
    assert (flat.microbatches, flat.microbatch_size) == (1, 4)
    with pytest.raises(PlanError, match="microbatches=4: without a pipeline"):
        best_plan(TOPOLOGY, PROFILE, BatchSettings(16, microbatches=4), options=PlanOptions(layout="flat_fsdp"))
