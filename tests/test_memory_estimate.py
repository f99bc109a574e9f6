"""The planner's memory estimate per device: what each rank holds under FSDP or replicas, in a pipeline or not;
and the memory benchmark's planning and verdicts.

The estimate is measured against real runs by `python -m holmes_lightning.bench bench=memory`
(docs/benchmark/memory.md), not here: a small job's RSS is mostly the process's baseline and allocator noise
(tests/test_bench.py runs the activation checkpointing runs small, and compares them with each other).
"""

from dataclasses import replace

import pytest

from holmes_lightning.bench.config import AC_VARIANTS, MEMORY_VARIANTS, ActivationsJob, BenchSettings
from holmes_lightning.bench.memory import MemoryRow, draw, markdown, plan_memory_variants
from holmes_lightning.cli.config import ConfigError, ModelConfig, StrategyConfig
from holmes_lightning.planner import BatchSettings, ModelProfile, PlanError, PlanOptions, Sharding, best_plan
from holmes_lightning.planner.cost import CostModel
from holmes_lightning.topology import Topology

GB = 1e9
PROFILE = ModelProfile.from_gpt(ModelConfig(name="gpt", n_layers=8, d_model=256, n_heads=4, seq_len=64), 4)
TOPOLOGY = Topology.from_config("two_cluster_mixed")


def test_replicas_hold_weights_grads_and_adamw_states_plus_the_stash():
    replicas = CostModel(TOPOLOGY, PROFILE, sharding=Sharding.none)
    assert replicas.memory_bytes(GB, dp=4, stash_bytes=0.1 * GB, pipelined=False) == pytest.approx(4.1 * GB)


def test_pipelined_fsdp_also_holds_the_stage_gathered_and_its_gradients_unsharded():
    fsdp = CostModel(TOPOLOGY, PROFILE, sharding=Sharding.fsdp)
    replicas = replace(fsdp, sharding=Sharding.none)
    assert fsdp.memory_bytes(GB, dp=4, stash_bytes=0.0, pipelined=True) == pytest.approx(GB + 2 * GB)
    same = {"dp": 4, "stash_bytes": 0.0, "pipelined": True}
    assert fsdp.memory_bytes(GB, **same) < replicas.memory_bytes(GB, **same)
    same["dp"] = 2  # two ranks: the sharded states save what the gathered copies cost
    assert fsdp.memory_bytes(GB, **same) == pytest.approx(replicas.memory_bytes(GB, **same))


def test_fsdp_without_a_pipeline_unshards_about_two_layers_at_a_time():
    fsdp = CostModel(TOPOLOGY, PROFILE, sharding=Sharding.fsdp)
    largest = max(layer.param_bytes for layer in PROFILE.layers)
    assert fsdp.memory_bytes(GB, dp=4, stash_bytes=0.0, pipelined=False) == pytest.approx(GB + 4 * largest)
    assert fsdp.memory_bytes(GB, dp=1, stash_bytes=0.0, pipelined=False) == pytest.approx(4 * GB)  # nothing to shard


def test_plans_report_the_estimate_of_their_worst_stage_and_the_memory_limit_uses_it():
    batch = BatchSettings(global_batch=8)
    found = best_plan(TOPOLOGY, PROFILE, batch, options=PlanOptions(pp=2, sharding="none", backend="gloo"))
    assert found.prediction.memory_gb == max(stage.memory_gb for stage in found.stages)
    for stage in found.stages:
        params = sum(PROFILE.layers[i].param_bytes for i in stage.layers)
        assert stage.memory_gb * GB > 4 * params  # weights, gradients, AdamW states, the activations in flight
    with pytest.raises(PlanError, match="memory_limit_gb"):
        best_plan(
            TOPOLOGY,
            PROFILE,
            batch,
            options=PlanOptions(pp=2, sharding="none", memory_limit_gb=found.prediction.memory_gb / 2),
        )


def test_memory_bench_plans_its_runs_and_judges_each_rank(tmp_path):
    model = ModelConfig(name="m", n_layers=4, d_model=64, n_heads=4, seq_len=16)
    activations = ActivationsJob(model=replace(model, name="long", seq_len=64), global_batch=8, microbatches=2)
    variants = [*MEMORY_VARIANTS, *AC_VARIANTS]
    settings = BenchSettings(
        name="memory", kind="memory", model=model, global_batch=4, variants=variants, activations=activations
    )
    planned = plan_memory_variants(TOPOLOGY, settings, StrategyConfig(pp=2))
    plans = [p.variant.plan for p in planned]
    assert [(p.pp, p.dp, p.sharding) for p in plans] == [(2, 2, "fsdp"), (2, 2, "none"), (2, 2, "none")] + [
        (2, 2, "fsdp")
    ] * 3
    assert [p.stages[0].checkpointing for p in plans[3:]] == ["off", "full", "selective"]
    assert {(p.global_batch, p.microbatches) for p in plans[3:]} == {(8, 2)}  # pinned: only checkpointing differs
    assert {p.trained.model.seq_len for p in planned} == {16, 64}
    off, full, selective = (p.stages[0].memory_gb for p in plans[3:])
    assert full < selective < off

    common = {"rank": 0, "stage": 0, "layers": "0-2", "stage_state_gb": 1.0, "baseline_gb": 0.4, "code_gb": 0.02}
    rows = [
        MemoryRow(variant="memory_fsdp", estimate_gb=1.1, peak_gb=1.62, **common),  # model 1.2: 1.2x state, -8%
        MemoryRow(variant="memory_replicas", estimate_gb=1.0, peak_gb=1.82, **common),  # model 1.4: above 1.25x
        MemoryRow(variant="memory_eager", estimate_gb=1.0, peak_gb=2.42, **common),  # before: no verdict
        MemoryRow(
            variant="memory_fsdp_ac_off",
            estimate_gb=3.2,
            peak_gb=3.42,
            checkpointing="off",
            losses=(5.5, 5.0),
            **common,
        ),
        MemoryRow(
            variant="memory_fsdp_ac_full",
            estimate_gb=1.0,
            peak_gb=1.72,
            checkpointing="full",
            losses=(5.5, 4.9),
            **common,
        ),
    ]
    assert [row.meets_targets for row in rows[:2]] == [True, False]
    assert [row.meets_targets for row in rows[3:]] == [True, False]  # 3.2 / 3.0: +7%; 1.0 / 1.3: -23%
    table = markdown(rows, planned, {"bench": "memory", "cluster": "two_cluster_mixed"})
    assert "| met |" in table and "| NOT met |" in table and "n/a (before)" in table and "1/2 ranks" in table
    assert "## Activation checkpointing" in table and "1/2 ranks -> NOT met" in table
    assert "full / off, model memory per rank: measured 0.43; estimated 0.31. Losses per step 5.5000, 4.9000" in table
    assert "largest difference to off's on any rank: 1.0e-01" in table
    draw(tmp_path / "memory.png", rows)
    assert (tmp_path / "memory.png").stat().st_size > 10_000


def test_memory_bench_runs_only_memory_variants():
    with pytest.raises(ConfigError, match="bench.variants"):
        BenchSettings(kind="memory")  # the speed variants by default
    with pytest.raises(ConfigError, match="bench.kind"):
        BenchSettings(kind="size")
    with pytest.raises(ConfigError, match="bench.activations"):
        BenchSettings(kind="memory", variants=["memory_fsdp_ac_full"])  # AC runs train their own job
    with pytest.raises(ConfigError, match="bench.activations.microbatches"):
        ActivationsJob(microbatches=0)
