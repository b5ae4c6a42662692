"""Communication: sparse and sketched collectives, and DDP comm hooks built on them."""
from fastdist.comm import hooks
from fastdist.comm.baselines import (
    BaselineStats,
    agsparse_allreduce,
    bf16_allreduce,
    dense_allreduce,
    fp16_allreduce,
    last_baseline_stats,
    make_powersgd_state,
    powersgd_allreduce,
    topk_allgather,
)
from fastdist.comm.sketch import (
    Channel,
    ExactTimings,
    SketchStats,
    default_call_counter,
    default_exact_timings,
    last_stats,
    sketch_allreduce,
)

__all__ = [
    "BaselineStats", "Channel", "ExactTimings", "SketchStats", "agsparse_allreduce", "bf16_allreduce", "default_call_counter",
    "default_exact_timings",
    "dense_allreduce", "fp16_allreduce", "hooks", "last_baseline_stats", "last_stats", "make_powersgd_state",
    "powersgd_allreduce", "sketch_allreduce", "topk_allgather",
]
