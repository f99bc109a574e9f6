"""The Holmes planner: pure Python over plain data (a Topology and a ModelProfile in, a Plan out)."""

from holmes_lightning.planner.cost import CostModel
from holmes_lightning.planner.plan_types import Plan, Sharding, StagePlan, StepPrediction
from holmes_lightning.planner.planner import BatchSettings, PlanError, PlanOptions, compare, on_shared_cores, plan
from holmes_lightning.planner.profile import LayerProfile, ModelProfile
from holmes_lightning.planner.schedules import SCHEDULES
from holmes_lightning.planner.simulate import Block, Timeline, simulate

__all__ = [
    "SCHEDULES",
    "BatchSettings",
    "Block",
    "CostModel",
    "LayerProfile",
    "ModelProfile",
    "Plan",
    "PlanError",
    "PlanOptions",
    "Sharding",
    "StagePlan",
    "StepPrediction",
    "Timeline",
    "compare",
    "on_shared_cores",
    "plan",
    "simulate",
]
