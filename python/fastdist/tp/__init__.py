"""Tensor parallelism with overlapped communication (Megatron linears, chunked; the Oases block schedule), the cost
model that picks chunk counts, and the planner that picks tensor-parallel degrees."""
from fastdist.tp.block import GPTBlock, OverlappedTransformerBlock
from fastdist.tp.chunks import chunk_bounds
from fastdist.tp.comm import CollectiveLog, count_collectives, high_priority_nccl_options
from fastdist.tp.cost import CostModel, TPOp, default_cost_model, set_default_cost_model
from fastdist.tp.linear import ColumnParallelLinear, RowParallelLinear
from fastdist.tp.parallelize import parallelize
from fastdist.tp.planner import ModelConfig, Plan, plan

__all__ = ["CollectiveLog", "ColumnParallelLinear", "CostModel", "GPTBlock", "ModelConfig",
           "OverlappedTransformerBlock", "Plan", "RowParallelLinear", "TPOp", "chunk_bounds", "count_collectives",
           "default_cost_model", "high_priority_nccl_options", "parallelize", "plan", "set_default_cost_model"]
