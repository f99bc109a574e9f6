"""The Holmes planner: pure Python over plain data (a Topology, a ModelProfile, what the user asks for and what the
machine costs in; a Plan out)."""

from holmes_lightning.planner.choice import (
    PlanError,
    best_plan,
    best_plan_per_replica,
    check_batch,
    check_degrees,
    compare_plans,
    on_shared_cores,
)
from holmes_lightning.planner.cost import CostModel, MachineCosts
from holmes_lightning.planner.options import (
    Backend,
    BatchSettings,
    Checkpointing,
    LayoutKind,
    PartitionRule,
    PlanOptions,
    Schedule,
    SettingError,
    Sharding,
)
from holmes_lightning.planner.plan_types import Plan, StagePlan, StepPrediction
from holmes_lightning.planner.profile import LayerProfile, ModelProfile
from holmes_lightning.planner.simulate import Block, Timeline, simulate

__all__ = [
    "Backend",
    "BatchSettings",
    "Block",
    "Checkpointing",
    "CostModel",
    "LayerProfile",
    "LayoutKind",
    "MachineCosts",
    "ModelProfile",
    "PartitionRule",
    "Plan",
    "PlanError",
    "PlanOptions",
    "Schedule",
    "SettingError",
    "Sharding",
    "StagePlan",
    "StepPrediction",
    "Timeline",
    "best_plan",
    "best_plan_per_replica",
    "check_batch",
    "check_degrees",
    "compare_plans",
    "on_shared_cores",
    "simulate",
]
