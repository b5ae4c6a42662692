"""Automated 3D parallelism (Merak): :func:`parallelize` trains an unmodified model over a (data, tensor, pipeline)
mesh, cutting it into balanced pipeline stages (:mod:`fastdist.parallel.partition`), sharding its blocks with
fastdist.tp and driving the stages with torch.distributed.pipelining's schedules and Merak's
(:mod:`fastdist.parallel.schedule`)."""
from fastdist.parallel.engine import (Engine, ParallelizeError, RankFailedError, parallelize,
                                      plain_optimizer_state_dict)
from fastdist.parallel.partition import Plan, StagePlan, plan_stages

__all__ = ["Engine", "ParallelizeError", "Plan", "RankFailedError", "StagePlan", "parallelize",
           "plain_optimizer_state_dict", "plan_stages"]
