"""Sharded embedding tables with AlltoAll lookups and gradients, owner-side sparse optimizers, and hybrid
parallelism: tables sharded, the dense rest data-parallel (EmbRace)."""
from fastdist.embedding.sharded import EmbeddingInputError, ShardedEmbedding, lookup, row_ranges, sharded_state_dict

__all__ = ["EmbeddingInputError", "ShardedEmbedding", "lookup", "row_ranges", "sharded_state_dict"]
