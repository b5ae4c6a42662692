"""Mixture-of-experts with expert parallelism and load-aware expert replication (Pro-Prophet)."""
from fastdist.moe.calibrate import calibrate
from fastdist.moe.data_parallel import aux_loss, data_parallel, expert_parameters, non_expert_parameters
from fastdist.moe.layer import MoELayer, UnmatchedCallError, step
from fastdist.moe.planner import CostModel, Plan, Planner, loads, plan_prophet, plan_replicate_topk, plan_shadow

__all__ = ["CostModel", "MoELayer", "Plan", "Planner", "aux_loss", "calibrate", "data_parallel", "expert_parameters",
           "loads", "non_expert_parameters", "plan_prophet", "plan_replicate_topk", "plan_shadow", "step",
           "UnmatchedCallError"]
