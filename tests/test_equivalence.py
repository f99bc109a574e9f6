"""HolmesStrategy pp=2 x dp=2 and pp=4 x dp=1 (4 gloo processes; the zero-bubble and V pipelines also pp=4 x dp=2
over three_cluster's 8) train exactly like one process on the same global batch.

One launch runs every case in turn; each case's per-step losses must match single-process training within 1e-4
relative (fp32), with AdamW, a step LR schedule and gradient clipping that is active (so the clipping norm has to
span both stages).
"""

from __future__ import annotations

from functools import cache, partial
from typing import Any

import lightning as L
import pytest
from distributed import WIDTHS, LossRecorder, TinyMLP, run_ranks, tiny_loader

SEED, STEPS, GLOBAL_BATCH, MICROBATCHES, DP = 7, 12, 16, 4, 2
VAL_SAMPLES, VAL_BATCHES, CLIP = 64, 2, 0.3
CASES: dict[str, dict[str, Any]] = {
    "gpipe_auto": {"schedule": "GPipe", "partition": "auto"},
    "gpipe_uneven": {"schedule": "GPipe", "partition": [2, 4]},
    "1f1b_auto": {"schedule": "1F1B", "partition": "auto", "validate": True},
    "1f1b_uniform": {"schedule": "1F1B", "partition": "uniform"},
    "interleaved_1f1b": {"schedule": "Interleaved1F1B", "partition": "uniform"},
    # weight-gradient passes apart from input-gradient passes, FSDP2 inside each stage; then one chunk per stage
    # (ZB1P), the cross-cluster hop between fabric hops, every layer recomputed before its input pass
    "interleaved_zero_bubble": {"schedule": "InterleavedZeroBubble", "partition": "auto"},
    "zero_bubble_pp4_full_checkpointing": {
        "schedule": "InterleavedZeroBubble",
        "partition": "uniform",
        "pp": 4,
        "dp": 1,
        "chunks_per_stage": 1,
        "checkpointing": "full",
    },
    # V placement: stage s holds virtual stages s and 3 - s, the turn at stage 1 handed over on its rank (also in
    # validation, forward only)
    "zbv_zero_bubble": {"schedule": "ZBVZeroBubble", "partition": "auto", "validate": True},
    "dual_pipe_v": {"schedule": "DualPipeV", "partition": "uniform", "validate": True},
    "1f1b_replicated_accumulate_2": {"schedule": "1F1B", "partition": "auto", "sharding": "none", "accumulate": 2},
    # each cluster's two stages pass activations in a group of their own on the fabric, the middle hop on TCP
    "1f1b_pp4_fabric_hops": {"schedule": "1F1B", "partition": "uniform", "pp": 4, "dp": 1},
    # every layer keeps only its input and runs its forward again in backward; then every other layer
    "1f1b_full_checkpointing": {"schedule": "1F1B", "partition": "auto", "checkpointing": "full"},
    "gpipe_selective_checkpointing": {"schedule": "GPipe", "partition": "uniform", "checkpointing": "selective"},
    # the first layer frozen and alone on its stage: the next stage's inputs need no gradient, its weights still do
    "zbv_first_layer_frozen": {"schedule": "ZBVZeroBubble", "partition": [1, 2, 2, 1], "frozen": 1},
    "interleaved_zero_bubble_first_layer_frozen": {
        "schedule": "InterleavedZeroBubble",
        "partition": [1, 2, 2, 1],
        "frozen": 1,
    },
}


def _trainer(max_steps: int, accumulate: int, validate: bool, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=CLIP,
        limit_val_batches=VAL_BATCHES if validate else 0,
        val_check_interval=10 if validate else None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def train_cases(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Rank side: fit every case with HolmesStrategy; per case the losses, partition and logged metrics."""
    from holmes_lightning import HolmesStrategy
    from holmes_lightning.planner import PlanOptions

    results = {}
    for name, case in cases.items():
        L.seed_everything(SEED)
        model, recorder = TinyMLP(widths=case.get("widths", WIDTHS)), LossRecorder()
        model.layers[: case.get("frozen", 0)].requires_grad_(False)
        accumulate = case.get("accumulate", 1)
        strategy = HolmesStrategy(
            cluster=case.get("cluster", "two_cluster_mixed"),
            schedule=case["schedule"],
            partition=case["partition"],
            sharding=case.get("sharding", "fsdp"),
            pp=case.get("pp", 2),
            dp=case.get("dp", DP),
            activation_checkpointing=case.get("checkpointing", "off"),
            options=PlanOptions(chunks_per_stage=case.get("chunks_per_stage", 2)),
            global_batch=GLOBAL_BATCH,
            microbatches=case.get("microbatches", MICROBATCHES),
            timeout=120,
            calibrate=False,  # plan from FLOPs: timed on a CPU, layers this small cost mostly their fixed overhead
        )
        validate = case.get("validate", False)
        trainer = _trainer(
            STEPS // accumulate,
            accumulate,
            validate,
            devices=1,
            num_nodes=case.get("nodes", 4),
            strategy=strategy,
            callbacks=[recorder],
        )
        per_replica = GLOBAL_BATCH // case.get("dp", DP)
        val_loader = tiny_loader(VAL_SAMPLES, per_replica, shuffle=False)
        trainer.fit(model, tiny_loader(STEPS * GLOBAL_BATCH, per_replica), val_loader if validate else None)
        metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
        revalidated = trainer.validate(model, val_loader, verbose=False)[0] if validate else {}
        results[name] = {
            "losses": recorder.losses,
            "chunks": [stage.chunks for stage in strategy.plan.stages],
            "stage": strategy.plan_mesh.stage,
            "recomputing": sum(isinstance(layer.forward, partial) for layer in model.pipeline_layers() if layer),
            "metrics": metrics,
            "revalidated": revalidated,
            "hop_peers": sorted(strategy.plan_mesh.hop_groups),
        }
    return results


@cache
def single_process(
    accumulate: int = 1, validate: bool = False, widths: tuple[int, ...] = WIDTHS, frozen: int = 0
) -> dict[str, Any]:
    L.seed_everything(SEED)
    model, recorder = TinyMLP(widths=widths), LossRecorder()
    model.layers[:frozen].requires_grad_(False)
    trainer = _trainer(STEPS // accumulate, accumulate, validate, devices=1, callbacks=[recorder])
    loader = tiny_loader(STEPS * GLOBAL_BATCH, GLOBAL_BATCH, single_process_seed=SEED)
    val_loader = tiny_loader(VAL_SAMPLES, GLOBAL_BATCH, shuffle=False)
    trainer.fit(model, loader, val_loader if validate else None)
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
    revalidated = trainer.validate(model, val_loader, verbose=False)[0] if validate else {}
    return {"losses": recorder.losses, "metrics": metrics, "revalidated": revalidated}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks("test_equivalence:train_cases", cases=CASES, timeout_s=600)


DEEP = (*WIDTHS[:-1], 16, 16, WIDTHS[-1])  # 8 layers: V placement over 4 stages needs 8 virtual stages
ON_THREE = {"partition": "auto", "pp": 4, "cluster": "three_cluster", "nodes": 8}
THREE_CLUSTERS = {  # 8 ranks on InfiniBand, RoCE and Ethernet: pp=4 x dp=2, the stages across all three
    "zero_bubble_three_clusters": {"schedule": "InterleavedZeroBubble", "chunks_per_stage": 1, **ON_THREE},
    "zbv_three_clusters": {"schedule": "ZBVZeroBubble", "widths": DEEP, **ON_THREE},
    "dual_pipe_v_three_clusters": {
        "schedule": "DualPipeV",
        "widths": DEEP,
        **ON_THREE,
        "partition": "uniform",
        "microbatches": 8,
    },
}


@pytest.mark.slow
def test_zero_bubble_and_v_pipelines_over_three_clusters_match_single_process() -> None:
    """ZB1P, ZBV and DualPipeV (8 micro-batches: DualPipeV needs one per virtual stage) over three fabrics."""
    ranks = run_ranks("test_equivalence:train_cases", cluster="three_cluster", cases=THREE_CLUSTERS, timeout_s=600)
    for name, case in THREE_CLUSTERS.items():
        reference = single_process(widths=case.get("widths", WIDTHS))["losses"]
        for rank, result in enumerate(ranks):
            assert result[name]["losses"] == pytest.approx(reference, rel=1e-4), f"{name}, rank {rank}"
            assert len(result[name]["chunks"][0]) == (2 if name != "zero_bubble_three_clusters" else 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_losses_match_single_process(name: str, ranks: list[dict[str, Any]]) -> None:
    reference = single_process(CASES[name].get("accumulate", 1), frozen=CASES[name].get("frozen", 0))["losses"]
    assert len(reference) == STEPS
    for rank, result in enumerate(ranks):
        assert result[name]["losses"] == pytest.approx(reference, rel=1e-4), f"rank {rank}"


@pytest.mark.slow
def test_partitions_run_as_planned_or_given(ranks: list[dict[str, Any]]) -> None:
    """Uniform, an explicit uneven split and interleaved chunks: each stage runs the layers the plan gives it (the
    auto partition may be uniform: of plans within 2% of the fastest the planner takes the least memory)."""
    assert ranks[0]["1f1b_uniform"]["chunks"] == [[[0, 3]], [[3, 6]]]
    assert ranks[0]["gpipe_uneven"]["chunks"] == [[[0, 2]], [[2, 6]]]
    assert [len(chunks) for chunks in ranks[0]["interleaved_1f1b"]["chunks"]] == [2, 2]
    assert [len(chunks) for chunks in ranks[0]["interleaved_zero_bubble"]["chunks"]] == [2, 2]
    assert ranks[0]["zero_bubble_pp4_full_checkpointing"]["chunks"] == [[[0, 2]], [[2, 4]], [[4, 5]], [[5, 6]]]
    assert ranks[0]["dual_pipe_v"]["chunks"] == [[[0, 2], [5, 6]], [[2, 4], [4, 5]]]  # V: stage 0 first and last


@pytest.mark.slow
def test_pipeline_neighbours_in_one_cluster_share_a_fabric_group(ranks: list[dict[str, Any]]) -> None:
    """two_cluster_mixed: ranks 0, 1 on InfiniBand (A), 2, 3 on RoCE (B); pp=4 pairs each rank with its cluster twin."""
    assert [rank["1f1b_pp4_fabric_hops"]["hop_peers"] for rank in ranks] == [[1], [0], [3], [2]]
    assert all(rank["1f1b_auto"]["hop_peers"] == [] for rank in ranks)  # pp=2: the one hop crosses the clusters


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.get("validate")])
def test_logged_losses_reach_every_rank_and_match(name: str, ranks: list[dict[str, Any]]) -> None:
    """Training and validation losses, the V schedules' too (torch's eval of a V schedule hands the turn's input
    gradients over on its rank, which a forward-only stage has none of)."""
    reference = single_process(validate=True)
    for result in (r[name] for r in ranks):
        assert result["metrics"]["train_loss"] == pytest.approx(reference["losses"][-1], rel=1e-4)
        assert result["metrics"]["val_loss"] == pytest.approx(reference["metrics"]["val_loss"], rel=1e-4)
        assert result["revalidated"]["val_loss"] == pytest.approx(reference["revalidated"]["val_loss"], rel=1e-4)


@pytest.mark.slow
def test_checkpointed_stages_recompute_the_layers_the_plan_names(ranks: list[dict[str, Any]]) -> None:
    """full wraps every layer a rank holds, selective the odd ones (by position in the model), off none; their
    losses match one process (`test_losses_match_single_process`)."""
    for rank in ranks:
        for case, wrapped in (
            ("1f1b_full_checkpointing", lambda i: True),
            ("gpipe_selective_checkpointing", lambda i: i % 2),
            ("zero_bubble_pp4_full_checkpointing", lambda i: True),
        ):
            held = [i for a, b in rank[case]["chunks"][rank[case]["stage"]] for i in range(a, b)]
            assert rank[case]["recomputing"] == sum(1 for i in held if wrapped(i)) > 0
        assert rank["1f1b_auto"]["recomputing"] == 0
