"""The planner's cost model is measured by an explicit, cacheable step: MoELayer.calibrate() keeps its measurement
in a file keyed by hardware and shape and reuses it when every rank finds it there; a planner without a cost model
raises on every rank instead of calibrating inside a forward; calibration leaves torch's global random state alone."""
import importlib
import os

import pytest
import torch
import torch.distributed as dist
from fastdist.distributed import spawn
from fastdist.moe import MoELayer, calibrate
from fastdist.moe.calibrate import clear_cache, hardware_key

CALIBRATION = importlib.import_module("fastdist.moe.calibrate")  # the module (fastdist.moe.calibrate is the function)

D, F_DIM, E = 16, 32, 4
SMALL = {"tokens": 64, "reps": 3}  # a quick measurement


def _calibrate_then_reload(folder):
    rank = dist.get_rank()
    path = os.path.join(folder, "moe.json")
    layer = MoELayer(D, F_DIM, E, k=2, dropless=True)
    measured = layer.calibrate(cache=path, **SMALL)
    clear_cache()

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured although every rank found the calibration in the file")

    measure, CALIBRATION._measure = CALIBRATION._measure, no_measuring
    try:
        reloaded = MoELayer(D, F_DIM, E, k=2, dropless=True).calibrate(cache=path, **SMALL)
    finally:
        CALIBRATION._measure = measure
    clear_cache()
    # rank 1 has no file of its own: every rank measures again (none waits for the others)
    lonely = os.path.join(folder, f"rank{rank}.json") if rank == 1 else path
    remeasured = MoELayer(D, F_DIM, E, k=2, dropless=True).calibrate(cache=lonely, **SMALL)
    return {"measured": measured, "reloaded": reloaded, "remeasured": remeasured, "file": open(path).read()}


def test_a_calibration_kept_in_a_file_is_reused_only_when_every_rank_finds_it(tmp_path):
    first, second = spawn(_calibrate_then_reload, 2, str(tmp_path), backend="gloo", timeout=120, threads_per_rank=1)
    assert first["measured"] == second["measured"]  # the slowest rank's figures everywhere
    assert first["reloaded"] == first["measured"] and second["reloaded"] == second["measured"]
    assert first["remeasured"] == second["remeasured"]
    assert "2 ranks" in first["file"] and f"d_model {D}, d_ff {F_DIM}" in first["file"]
    assert os.path.exists(tmp_path / "rank1.json")


def test_the_hardware_key_names_the_device_threads_ranks_and_torch():
    key = hardware_key(torch.device("cpu"), 4, "gloo")
    assert key.startswith("cpu ") and f"{torch.get_num_threads()} threads" in key and "4 ranks" in key
    assert "gloo" in key and torch.__version__ in key


def _forward_without_cost_model(balance):
    layer = MoELayer(D, F_DIM, E, k=2, dropless=True, balance=balance)
    try:
        layer(torch.randn(8, D))
    except RuntimeError as err:
        return str(err)
    return None


@pytest.mark.parametrize("balance", ["prophet", "shadow"])
def test_a_planner_without_a_cost_model_raises_on_every_rank_instead_of_calibrating(balance):
    messages = spawn(_forward_without_cost_model, 2, balance, backend="gloo", timeout=60, threads_per_rank=1)
    assert all(m is not None and "has none: call layer.calibrate()" in m for m in messages), messages


def test_calibration_leaves_the_global_random_state_as_it_was():
    clear_cache()
    torch.manual_seed(0)
    layer = MoELayer(D, F_DIM, E, k=2, dropless=True)
    before = torch.get_rng_state()
    layer.calibrate(**SMALL)
    calibrate(None, D, 2 * F_DIM, num_experts=E, k=2, **SMALL)  # the module function, another shape
    assert torch.equal(torch.get_rng_state(), before)
