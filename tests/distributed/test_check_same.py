"""fastdist.distributed.check_same / fingerprint: agreement across ranks, checked cheaply."""
import dataclasses
import enum

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fastdist.distributed import MismatchError, check_same, fingerprint, spawn


class Mode(enum.Enum):
    SKETCH = 1
    EXACT = 2


@dataclasses.dataclass
class Config:
    rows: int
    seed: int


def test_fingerprint_is_equal_for_equal_values_and_differs_for_different_ones():
    same = [
        (3, 3), ("sketch", "sketch"), ((1, 2.5), (1, 2.5)), ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
        (torch.arange(5), torch.arange(5)), (np.arange(4), np.arange(4)), (Config(3, 0), Config(3, 0)),
        (torch.Size([2, 3]), (2, 3)), ({3, 1}, {1, 3}), (Mode.EXACT, Mode.EXACT), (torch.float32, torch.float32),
    ]
    for a, b in same:
        assert fingerprint(a) == fingerprint(b), (a, b)
    different = [
        (1, 1.0), (1, True), ("1", 1), ((1, 2), (2, 1)), ([1, [2]], [[1], 2]),
        (torch.arange(5), torch.arange(5).float()), (torch.zeros(2, 3), torch.zeros(3, 2)),
        (torch.zeros(4), torch.tensor([0.0, 0.0, 0.0, 1e-30])), (Config(3, 0), Config(3, 1)),
        (Mode.SKETCH, Mode.EXACT), (0.1, 0.1 + 1e-17 if 0.1 + 1e-17 != 0.1 else 0.10000000000000002),
    ]
    for a, b in different:
        assert fingerprint(a) != fingerprint(b), (a, b)


def test_fingerprint_of_an_unsupported_type_is_a_clear_type_error():
    with pytest.raises(TypeError, match="cannot fingerprint a object"):
        fingerprint(object())


def _check_matrix():
    """{field: the MismatchError's message on this rank, or None} after equal values passed (or the rank raised)."""
    rank = dist.get_rank()
    messages = {}
    check_same("seed", 1234)
    check_same("table", torch.arange(100).reshape(10, 10))
    check_same("config", {"rows": 3, "cols": 4096, "mode": Mode.SKETCH})
    for name, value in [("cols", 4096 + (rank == 2)), ("splits", torch.tensor([1, 2, 3]) * (1 + (rank == 3)))]:
        try:
            check_same(name, value)
            messages[name] = None
        except MismatchError as e:
            messages[name] = str(e)
    # a subgroup without the disagreeing rank agrees; the mismatch did not desynchronize the group
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        check_same("cols", 4096 + (rank == 2), group=sub)
    dist.barrier()
    return messages


def test_a_mismatch_raises_on_every_rank_naming_the_field_and_each_ranks_value():
    for rank, out in enumerate(spawn(_check_matrix, 4, timeout=120)):
        assert out["cols"] is not None and out["splits"] is not None, (rank, out)
        assert "'cols' differs across ranks" in out["cols"], (rank, out)
        assert "rank 2: 4097" in out["cols"] and "rank 0: 4096" in out["cols"]
        assert "'splits' differs across ranks" in out["splits"]
        assert "rank 3: tensor(shape=(3,)" in out["splits"]


def test_check_same_without_a_process_group_says_what_is_missing():
    with pytest.raises(RuntimeError, match="initialized torch.distributed process group"):
        check_same("seed", 1)
