"""fastdist.memory: fit training into less memory by swapping and recomputing activations (DELTA).

SwapPrefetcher swaps saved activations out during forward and prefetches them back during backward;
plan/apply/optimize choose, per named segment of a model, whether to keep, swap or recompute its activations.
"""
from fastdist.memory.calibrate import CopyModel, calibrate
from fastdist.memory.planner import (
                                     AppliedPlan,
                                     Plan,
                                     Profile,
                                     Segment,
                                     apply,
                                     default_segments,
                                     optimize,
                                     plan,
                                     plan_from_profile,
                                     profile,
)
from fastdist.memory.prefetcher import SwapPrefetcher

__all__ = ["AppliedPlan", "CopyModel", "Plan", "Profile", "Segment", "SwapPrefetcher", "apply", "calibrate",
           "default_segments", "optimize", "plan", "plan_from_profile", "profile"]
