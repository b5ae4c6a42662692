"""Multi-rank plumbing: the local runner and the cross-rank agreement check."""
from fastdist.distributed.fingerprint import MismatchError, check_same, fingerprint
from fastdist.distributed.spawn import RankError, resolve_backend, spawn

__all__ = ["MismatchError", "RankError", "check_same", "fingerprint", "resolve_backend", "spawn"]
