"""Mixture-of-experts with expert parallelism and load-aware expert replication (Pro-Prophet)."""
from fastdist.moe.calibrate import calibrate
from fastdist.moe.layer import MoELayer
from fastdist.moe.planner import CostModel, Plan, Planner, loads, plan_prophet, plan_replicate_topk, plan_shadow

__all__ = ["CostModel", "MoELayer", "Plan", "Planner", "calibrate", "loads", "plan_prophet", "plan_replicate_topk",
           "plan_shadow"]
