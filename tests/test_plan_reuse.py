"""When a resume runs its checkpoint's plan again: what a checkpoint records of its plan, and why a changed job replans.

Single-process and pure: real plans from the planner, real checkpoints on disk (DCP without a process group). The
multi-process resume that reuses the plan and reproduces the uninterrupted losses is in test_resume.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from torch import nn

from holmes_lightning import planner
from holmes_lightning.cli.config import ModelConfig
from holmes_lightning.planner import Backend, BatchSettings, MachineCosts, ModelProfile, Plan, PlanOptions
from holmes_lightning.runtime import checkpoint
from holmes_lightning.runtime.plan_reuse import PlanBasis, replan_reasons
from holmes_lightning.runtime.planning import PlanRequest
from holmes_lightning.topology import Topology

PROFILE = ModelProfile.from_gpt(ModelConfig(n_layers=4, d_model=16, n_heads=2, seq_len=8))
CLUSTER = Topology.from_config("two_cluster_mixed")
ONE_RANK = Topology.from_config("single_node", devices_per_node=1)  # a checkpoint saved by this one process


def request(**changes: object) -> PlanRequest:
    """What a user asks HolmesStrategy for; `changes` replace fields of it."""
    asked = PlanRequest(options=PlanOptions(), batch=BatchSettings(16), costs=MachineCosts(), calibrate=True)
    return replace(asked, **changes)


def basis(asked: PlanRequest | None = None, topology: Topology = CLUSTER) -> PlanBasis:
    return PlanBasis.of(topology, (asked or request()).fixed_settings(Backend.gloo))


def saved_plan(topology: Topology = CLUSTER) -> Plan:
    options = PlanOptions(backend=Backend.gloo)
    return planner.best_plan(topology, PROFILE, BatchSettings(16), options=options, costs=MachineCosts())


def reasons(made_for: PlanBasis | None, current: PlanBasis, topology: Topology = CLUSTER, **job: int) -> list[str]:
    """Why this job replans the plan saved for `made_for`: `job` gives num_layers and replica_batch if not these."""
    stored = None if made_for is None else json.loads(json.dumps(made_for.to_dict()))  # as plan.json holds it
    return replan_reasons(
        saved_plan(),
        stored,
        current=current,
        world_size=topology.world_size,
        num_layers=job.get("num_layers", PROFILE.num_layers),
        replica_batch=job.get("replica_batch"),
    )


def test_the_same_cluster_model_and_request_reuse_the_plan() -> None:
    assert reasons(basis(), basis()) == []
    assert reasons(basis(), basis(), replica_batch=saved_plan().replica_batch) == []


def test_replan_alone_is_no_change_of_request() -> None:
    assert reasons(basis(), basis(request(replan=True))) == []  # replan=True acts before the comparison


def test_each_changed_setting_is_named_with_both_values() -> None:
    changed = request(
        options=PlanOptions(schedule="GPipe", partition=[2, 4]),
        batch=BatchSettings(16, microbatches=4),
        precision="bf16-mixed",
    )
    assert reasons(basis(), basis(changed)) == [
        "schedule='1F1B' there, 'GPipe' here",
        "partition='auto' there, [2, 4] here",
        "microbatches=None there, 4 here",
        "precision='32-true' there, 'bf16-mixed' here",
    ]


def test_given_costs_profile_and_plan_belong_to_the_request() -> None:
    changed = request(costs=MachineCosts(dp_overlap=0.9), profile=PROFILE, plan=saved_plan())
    found = reasons(basis(), basis(changed))
    assert found[0] == "costs.dp_overlap=0.5 there, 0.9 here"
    assert found[1].startswith("profile=None there, '") and found[2] == "given_plan=False there, True here"


def test_another_world_size_or_cluster_replans() -> None:
    eight = Topology.from_config("paper_4ib_4roce", devices_per_node=1)
    assert reasons(basis(), basis(topology=eight), topology=eight)[0] == "4 ranks there, 8 here"
    faster = Topology.from_config("two_cluster_mixed", inter_cluster={"gbps": 400.0})
    assert reasons(basis(), basis(topology=faster)) == ["another cluster (spec.inter_cluster differ)"]


def test_another_model_or_data_loader_batch_replans() -> None:
    assert reasons(basis(), basis(), num_layers=7) == [f"{PROFILE.num_layers} pipeline layers there, 7 here"]
    size = saved_plan().replica_batch
    assert reasons(basis(), basis(), replica_batch=size + 1) == [
        f"the DataLoader's batch_size={size} there, {size + 1} here"
    ]


def test_a_checkpoint_without_the_record_replans() -> None:
    assert reasons(None, basis()) == [
        "the checkpoint does not say what its plan was made for (saved by an older version)"
    ]


def _save(path: Path, made_for: PlanBasis | None) -> None:
    state = {"state_dict": checkpoint.model_state(nn.Linear(2, 2)), "global_step": 3, "epoch": 0}
    record = None if made_for is None else made_for.to_dict()
    checkpoint.save(state, path, plan=saved_plan(ONE_RANK), rank=0, made_for=record)


def test_a_checkpoint_stores_its_plan_with_what_it_was_made_for(tmp_path: Path) -> None:
    _save(tmp_path / "step_000003.ckpt", basis(topology=ONE_RANK))
    plan, made_for = checkpoint.stored_plan(tmp_path / "step_000003.ckpt")
    assert plan == saved_plan(ONE_RANK)
    assert PlanBasis.from_dict(made_for) == basis(topology=ONE_RANK)
    checkpoint.check(tmp_path / "step_000003.ckpt", plan)  # its digests and layer count check as before


def test_an_older_plan_json_still_loads_without_the_record(tmp_path: Path) -> None:
    _save(tmp_path / "step_000003.ckpt", None)
    assert "made_for" not in json.loads((tmp_path / "step_000003.ckpt" / "plan.json").read_text())
    assert checkpoint.stored_plan(tmp_path / "step_000003.ckpt") == (saved_plan(ONE_RANK), None)
