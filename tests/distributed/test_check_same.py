"""fastdist.distributed.check_same / fingerprint: agreement across ranks, checked cheaply."""
import dataclasses
import enum
import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fastdist.distributed import CallCounter, MismatchError, check_same, fingerprint, global_ranks, spawn


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


def _check_configs():
    """The MismatchError's message on this rank for a dict config and a dataclass config differing in one field."""
    rank = dist.get_rank()
    messages = {}
    configs = {"dict": {"rows": 3, "cols": 4096, "sketch": {"seed": 7 + rank, "mode": Mode.SKETCH}},
               "dataclass": Config(rows=3, seed=rank)}
    for name, config in configs.items():
        try:
            check_same(name, config)
            messages[name] = None
        except MismatchError as e:
            messages[name] = str(e)
    return messages


def test_a_config_mismatch_names_only_the_differing_fields_with_each_ranks_value():
    for out in spawn(_check_configs, 2, timeout=120):
        assert "'dict: sketch.seed' differs across ranks" in out["dict"]
        assert "rank 0: sketch.seed=7; rank 1: sketch.seed=8" in out["dict"]
        assert "cols" not in out["dict"]
        assert "'dataclass: seed' differs across ranks (rank 0: seed=0; rank 1: seed=1)" in out["dataclass"]


def test_call_counter_numbers_calls_from_zero_and_round_trips_its_state():
    counter = CallCounter()
    assert [counter.take() for _ in range(3)] == [0, 1, 2]
    resumed = CallCounter()
    resumed.load_state_dict(pickle.loads(pickle.dumps(counter.state_dict())))
    assert resumed.take() == 3


def test_call_counter_check_names_each_ranks_call_number():
    CallCounter().check("layer", {0: 5, 1: 5, 2: 5})
    with pytest.raises(MismatchError, match=r"'layer call number \(a rank skipped or added a call\)' differs across "
                                            r"ranks \(rank 0: 5; rank 1: 6\)"):
        CallCounter().check("layer", {0: 5, 1: 6})


def _exchange_with_numbered_calls(calls_on_rank1):
    """Calls a per-call all-gather of (call number, payload size) up to 3 times, rank 1 making only the calls in
    `calls_on_rank1`: the MismatchError message of each call on this rank (the first one ends the loop), or None
    where the call passed."""
    counter = CallCounter()
    outcomes = []
    for call in range(3):
        if dist.get_rank() == 1 and call not in calls_on_rank1:
            counter.take()  # the skipped call would have counted too: the next one carries number 2
            continue
        mine = torch.tensor([counter.take(), 16])
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        try:
            counter.check("exchange", dict(zip(global_ranks(), [int(g[0]) for g in gathered])))
            outcomes.append(None)
        except MismatchError as e:
            outcomes.append(str(e))
            break
    return outcomes


def test_a_rank_that_skips_a_call_is_caught_by_the_call_number_in_the_exchange():
    agreeing = spawn(_exchange_with_numbered_calls, 2, (0, 1, 2), timeout=120)
    assert agreeing == [[None, None, None], [None, None, None]]
    rank0, rank1 = spawn(_exchange_with_numbered_calls, 2, (0, 2), timeout=120)
    assert rank0[0] is None and rank1[0] is None and len(rank0) == len(rank1) == 2
    assert "rank 0: 1; rank 1: 2" in rank0[1] and "rank 0: 1; rank 1: 2" in rank1[1]
