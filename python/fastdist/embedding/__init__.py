"""Sharded embedding tables with AlltoAll lookups and gradients, owner-side sparse optimizers, and hybrid
parallelism: tables sharded, the dense rest data-parallel (EmbRace)."""
from fastdist.embedding.fused import LookupFusion, fuse_lookups
from fastdist.embedding.hybrid import ShardedEmbeddingCollection, balance_tables, hybrid_parallel
from fastdist.embedding.optim import RowWiseAdagrad, RowWiseAdam, RowWiseSGD
from fastdist.embedding.schedule import CollectiveQueue
from fastdist.embedding.sharded import (EmbeddingInputError, ShardedEmbedding, lookup, prefetch, row_ranges,
                                       sharded_state_dict)

__all__ = ["CollectiveQueue", "EmbeddingInputError", "LookupFusion", "RowWiseAdagrad", "RowWiseAdam", "RowWiseSGD",
           "ShardedEmbedding", "ShardedEmbeddingCollection", "balance_tables", "fuse_lookups", "hybrid_parallel",
           "lookup", "prefetch", "row_ranges", "sharded_state_dict"]
