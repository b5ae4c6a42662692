"""Multi-rank plumbing: the local runner, the cross-rank agreement check, and the failure of a rank made every
rank's error (:mod:`fastdist.distributed.failure`)."""
from fastdist.distributed.fingerprint import (
    CallCounter,
    MismatchError,
    check_same,
    fingerprint,
    global_ranks,
    raise_mismatch,
    state_digest,
)
from fastdist.distributed.failure import JobFailureError, RankFailedError
from fastdist.distributed.spawn import RankError, resolve_backend, spawn

__all__ = ["CallCounter", "JobFailureError", "MismatchError", "RankError", "RankFailedError", "check_same",
           "fingerprint", "global_ranks", "raise_mismatch", "resolve_backend", "spawn", "state_digest"]
