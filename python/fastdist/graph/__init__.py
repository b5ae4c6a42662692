"""fastdist.graph: hierarchical adaptive graph pooling (HAP) for graph classification.

`HAPPool` is one coarsening level on dense batched graphs (plain torch); `SparseHAPPool` and `densify` take PyG's
sparse batch; `GraphClassifier` / `HAPClassifier` put a GNN encoder, pooling levels (HAP or one of PyG's poolers),
a readout and a classifier together; `fastdist.graph.data` generates graph-classification sets without downloads.
torch_geometric is an optional extra: `import fastdist.graph` and the dense `HAPPool` work without it; densifying a
sparse batch and the classifiers' encoders import it on first use and say which extra to install if it is missing.
"""
from fastdist.graph.pool import HAPPool, PoolLosses, SparseHAPPool, densify

__all__ = ["POOLERS", "GraphClassifier", "HAPClassifier", "HAPPool", "PoolLosses", "SparseHAPPool", "data",
           "densify"]


def __getattr__(name: str):
    # The classifiers and the data generators load on first use: they are not needed for the dense pool.
    if name in ("GraphClassifier", "HAPClassifier", "POOLERS"):
        from fastdist.graph import classifier

        return getattr(classifier, name)
    if name == "data":
        import importlib

        return importlib.import_module("fastdist.graph.data")
    raise AttributeError(f"module 'fastdist.graph' has no attribute {name!r}")
