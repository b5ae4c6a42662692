"""Every distributed API, one argument changed on one rank: MismatchError on every rank naming the field, within the
timeout; never a hang, an abort, or a silent wrong result. Where a change must not matter, every rank agrees. Where
only some ranks can know (ONE_SIDED), those raise naming it and the others finish.

Each API's cases run one after another in one 2-rank job (disagreement_ranks.run_cases), each on a group of its own
with a short timeout, so a hang shows up as its case's timeout error; the job runs once, at the API's first case.
"""
import pytest
import torch

from disagreement_ranks import CASES, run_cases
from fastdist.distributed import spawn

TIMEOUT_S = 240  # the whole job of an API; a hung case gives up after disagreement_ranks.CASE_TIMEOUT_S
RECEIVER_ONLY = {"send/recv"}  # one-way: the sender has returned before the receiver can find a mismatch

# (api, case) -> the ranks that can know. A rank that skips a call of the model's only MoE layer, without step
# numbers, numbers its later calls alike: nothing on it can tell. The rank left with a call more must raise, naming
# the skipped call, at the group's timeout.
ONE_SIDED = {("MoELayer", "skipped call of the only layer"): {0}}


def _params():
    for api, cases in CASES.items():
        for name in cases:
            yield pytest.param(api, name, id=f"{api}: {name}")


@pytest.fixture(scope="module")
def outcomes():
    """{api: every rank's report}, each API's job run at its first case."""
    done = {}

    def of(api):
        if api not in done:
            done[api] = spawn(run_cases, 2, api, list(CASES[api]), backend="gloo", timeout=TIMEOUT_S,
                              threads_per_rank=1)
        return [report for report in done[api]]
    return of


@pytest.mark.parametrize("api, name", list(_params()))
def test_one_rank_changing_one_argument_raises_on_every_rank_naming_it_or_changes_nothing(outcomes, api, name):
    _, field, own_error = CASES[api][name]
    reports = [r[name] for r in outcomes(api)]
    if field is None:
        assert all(kind == "ok" for kind, _ in reports), reports
        first = reports[0][1]
        for _, value in reports[1:]:
            assert len(value) == len(first) and all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                                                    for a, b in zip(value, first))
        return
    if (api, name) in ONE_SIDED:
        knowing = ONE_SIDED[api, name]
        for rank, (kind, message) in enumerate(reports):
            if rank in knowing:
                assert kind == "error" and field in message and "moe.step" in message, f"rank {rank}: {message}"
            else:
                assert kind == "ok", f"rank {rank}: {kind}: {message}"
        return
    raising = [1] if api in RECEIVER_ONLY else range(len(reports))
    for rank in raising:
        kind, message = reports[rank]
        if rank in own_error:  # its own input is invalid: its own error, naming what
            assert kind == "ValueError" and field in message, f"rank {rank}: {kind}: {message}"
            continue
        assert kind == "mismatch", f"rank {rank}: {kind}: {message}"
        named = "invalid input" if own_error else field  # the others learn only that rank 1's input was invalid
        assert named in message and "rank 1" in message, f"rank {rank}: {message}"
