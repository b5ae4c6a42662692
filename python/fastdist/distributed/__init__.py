"""Multi-rank plumbing: the local runner and the cross-rank agreement check."""
from fastdist.distributed.fingerprint import (
    CallCounter,
    MismatchError,
    check_same,
    fingerprint,
    global_ranks,
    raise_mismatch,
    state_digest,
)
from fastdist.distributed.spawn import RankError, resolve_backend, spawn

__all__ = ["CallCounter", "MismatchError", "RankError", "check_same", "fingerprint", "global_ranks", "raise_mismatch",
           "resolve_backend", "spawn", "state_digest"]
