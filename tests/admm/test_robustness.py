"""ADMMiRNN as a user relies on it: the residuals vanish where a zero-residual solution exists, the run is
determined by its seed whatever the thread count, a state_dict resumes it bit for bit, bad input and bad
hyper-parameters raise naming the problem, and divergence raises naming the block instead of returning NaNs."""
import io
import math
import re

import pytest
import torch
from fastdist.admm import ADMMDivergenceError, ADMMiRNN
from fastdist.bench.report import torch_threads

F, H, O, T = 3, 8, 2, 5


def batch(n=32, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, T, F, generator=g, dtype=torch.float64).to(dtype)


def test_residuals_go_to_zero_and_the_network_fits_labels_a_teacher_rnn_separates():
    x = batch()
    y = ADMMiRNN(F, H, O, T, dtype=torch.float64, seed=7).forward(x).argmax(1)  # a zero-residual solution exists
    m = ADMMiRNN(F, H, O, T, rho=1.0, duals="all", weight_decay=1e-3, dtype=torch.float64)
    first = m.step(x, y)
    for _ in range(199):
        stats = m.step(x, y)
    assert max(stats.residuals.values()) < 1e-4 < max(first.residuals.values())
    assert stats.loss == pytest.approx(stats.aux_loss, abs=1e-3)  # the network itself reaches what o reached
    assert bool((m.forward(x).argmax(1) == y).all())


def run(sweeps, threads=None, dtype=torch.float32, seed=0):
    x = batch(24, dtype=dtype)
    y = torch.arange(24) % O
    with torch_threads(threads):
        m = ADMMiRNN(F, H, O, T, rho=2.0, seed=seed, dtype=dtype)
        stats = [m.step(x, y) for _ in range(sweeps)]
    return m, stats


def assert_same_state(a, b):
    for group in ("weights", "variables", "dual"):
        for k, v in getattr(a, group).items():
            assert torch.equal(v, getattr(b, group)[k]), f"{group}[{k}] differs"


def test_the_same_seed_gives_the_same_run_bit_for_bit_at_one_and_two_threads():
    one, stats_one = run(5, threads=1)
    two, stats_two = run(5, threads=2)
    assert_same_state(one, two)
    assert stats_one == stats_two
    other, _ = run(1, seed=1)
    assert not torch.equal(one.weights["w"], other.weights["w"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_resuming_from_a_state_dict_continues_the_run_exactly(dtype):
    x = batch(20, dtype=dtype)
    y = torch.arange(20) % O
    straight = ADMMiRNN(F, H, O, T, dtype=dtype)
    want = [straight.step(x, y) for _ in range(6)]
    first = ADMMiRNN(F, H, O, T, dtype=dtype)
    got = [first.step(x, y) for _ in range(3)]
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = ADMMiRNN(F, H, O, T, dtype=dtype)
    resumed.load_state_dict(torch.load(buffer))
    got += [resumed.step(x, y) for _ in range(3)]
    assert got == want
    assert_same_state(resumed, straight)
    assert resumed.history == straight.history and resumed.sweeps == 6
    assert resumed.loss_reference == straight.loss_reference is not None


def test_a_state_dict_of_another_configuration_is_refused_naming_the_field():
    state = ADMMiRNN(F, H, O, T, tau=2.0).state_dict()
    with pytest.raises(ValueError, match="tau"):
        ADMMiRNN(F, H, O, T).load_state_dict(state)


def test_float32_follows_the_float64_trajectory_over_the_first_sweeps():
    _, single = run(5, dtype=torch.float32)
    _, double = run(5, dtype=torch.float64)
    for s, d in zip(single, double):
        assert s.lagrangian == pytest.approx(d.lagrangian, rel=1e-4)
        assert s.loss == pytest.approx(d.loss, rel=1e-4)


@pytest.mark.parametrize("kwargs,match", [
    ({"rho": 0.0}, "rho"), ({"rho": -1.0}, "rho"), ({"rho": math.nan}, "rho"), ({"rho": 1e7}, "rho"),
    ({"rho": {"a": 1.0, "s": 1.0}}, "rho"), ({"rho": {"a": 1.0, "s": 1.0, "o": 0.0}}, r"rho\['o'\]"),
    ({"tau": 0.5}, "tau"), ({"tau": math.inf}, "tau"), ({"loss": "hinge"}, "loss"), ({"duals": "some"}, "duals"),
    ({"damping": 0.0}, "damping"), ({"weight_decay": -1.0}, "weight_decay"), ({"dtype": torch.float16}, "dtype"),
    ({"divergence_loss_factor": 0.5}, "divergence_loss_factor"),
])
def test_hyper_parameters_out_of_range_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ADMMiRNN(F, H, O, T, **kwargs)


def test_bad_batches_are_refused_with_a_clear_error():
    m = ADMMiRNN(F, H, O, T)
    x, y = batch(6, dtype=torch.float32), torch.zeros(6, dtype=torch.int64)
    cases = [
        (x[:, :-1], y, r"shape \[B, 5, 3\]"), (x[..., :2], y, "input_size"), (x[0], y, "shape"),
        (x[:0], y[:0], "empty"), (x.long(), y, "floating point"), (x, y[:4], r"shape \[6\]"),
        (x, y.float(), "int64"), (x, y + O, "outside"),
        (torch.where(torch.arange(6).view(6, 1, 1) == 2, math.nan, x), y, "non-finite"),
        (torch.where(torch.arange(6).view(6, 1, 1) == 2, math.inf, x), y, "non-finite"),
    ]
    for bad_x, bad_y, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            m.step(bad_x, bad_y)
    assert m.sweeps == 0 and m.batch_size is None
    reg = ADMMiRNN(F, H, 1, T, loss="mse")
    with pytest.raises(ValueError, match="non-finite"):
        reg.step(x, torch.full((6,), math.nan))


def test_a_batch_of_another_size_is_refused_once_the_variables_are_bound():
    m = ADMMiRNN(F, H, O, T)
    m.step(batch(6, dtype=torch.float32), torch.zeros(6, dtype=torch.int64))
    with pytest.raises(ValueError, match="bound to a batch of 6 samples, got 7"):
        m.step(batch(7, dtype=torch.float32), torch.zeros(7, dtype=torch.int64))


def test_overflowing_values_raise_a_divergence_error_naming_the_block_not_nans():
    m = ADMMiRNN(F, H, O, T)
    x = torch.full((5, T, F), 3e38)
    with pytest.raises(ADMMDivergenceError) as err:
        m.step(x, torch.zeros(5, dtype=torch.int64))
    assert err.value.block.startswith("a (t=")
    with pytest.raises(ADMMDivergenceError, match="diverged earlier"):  # no further sweeps on a broken state
        m.step(x, torch.zeros(5, dtype=torch.int64))


def test_a_residual_growing_over_the_whole_window_raises_naming_its_constraint():
    m = ADMMiRNN(F, H, O, T, divergence_window=4, divergence_factor=10.0)
    m._watch({"a": 1.0, "s": 1.0, "o": 1.0})
    for growth in (2.0, 4.0, 8.0):  # growing, but not yet over the window and not 10x
        m._watch({"a": 1.0, "s": growth, "o": 1.0})
    with pytest.raises(ADMMDivergenceError, match="'s' grew in each of the last 4 sweeps") as err:
        m._watch({"a": 1.0, "s": 16.0, "o": 1.0})
    assert err.value.block == "r_s"
    calm = ADMMiRNN(F, H, O, T, divergence_window=4)
    for value in (1.0, 2.0, 4.0, 3.0, 30.0):  # one dip inside the window: not divergence
        calm._watch({"a": value, "s": 1.0, "o": 1.0})


@pytest.mark.cuda
def test_cuda_follows_the_cpu_trajectory():
    x = batch(16)
    y = torch.arange(16) % O
    cpu = ADMMiRNN(F, H, O, T, dtype=torch.float64)
    gpu = ADMMiRNN(F, H, O, T, dtype=torch.float64, device="cuda")
    for _ in range(3):
        a, b = cpu.step(x, y), gpu.step(x.cuda(), y.cuda())
        assert b.lagrangian == pytest.approx(a.lagrangian, rel=1e-9)
    torch.testing.assert_close(gpu.weights["w"].cpu(), cpu.weights["w"])


def digits_rows(samples):
    from sklearn.datasets import load_digits
    d = load_digits()
    return torch.tensor(d.images[:samples], dtype=torch.float32) / 16.0, torch.tensor(d.target[:samples])


def test_a_network_loss_past_its_bound_raises_naming_where_the_forward_pass_leaves_the_auxiliary_states():
    # a recorded case (init scale 0.01, digits rows): the auxiliary loss falls every sweep while the network's own
    # loss climbs from 2.30 to 3.3 around sweep 8, its residuals 0.1-0.3
    x, y = digits_rows(300)
    m = ADMMiRNN(8, 16, 10, 8, rho=1.0, weight_decay=1e-3, init_scale=0.01, divergence_loss_factor=1.2)
    losses = []
    with pytest.raises(ADMMDivergenceError, match=r"network's loss .* passed 1.2 x its reference 2.30") as err:
        for _ in range(12):
            losses.append(m.step(x, y).loss)
    assert m.loss_reference == pytest.approx(2.303, abs=1e-3)  # the 10 classes' prior and the start's loss
    assert len(losses) >= 5 and max(losses) <= 1.2 * m.loss_reference  # it fires when the loss climbs, not before
    assert re.fullmatch(r"s \(t=\d\)", err.value.block) and m.state_dict()["loss_reference"] == m.loss_reference
    with pytest.raises(ADMMDivergenceError, match="diverged earlier"):
        m.step(x, y)


def test_the_loss_bound_names_the_output_when_the_auxiliary_loss_is_past_it_too():
    m = ADMMiRNN(F, H, O, T, divergence_loss_factor=1.0)
    x, y = batch(8, dtype=torch.float32), torch.arange(8) % O
    m.step(x, y)
    m.loss_reference = 1e-6  # as if the first batch had been fitted exactly: every loss now passes the bound
    with pytest.raises(ADMMDivergenceError) as err:
        m.step(x, y)
    assert err.value.block == "o"


def test_in_mini_batches_the_loss_bound_names_the_step_from_the_batchs_own_variables():
    x, y = batch(32, dtype=torch.float64), torch.arange(32) % O
    first, second = torch.arange(16), torch.arange(16, 32)

    def model():
        return ADMMiRNN(F, H, O, T, minibatch="carry", num_samples=32, dtype=torch.float64)

    free = model()
    free.step(x[first], y[first], first)
    stats = free.step(x[second], y[second], second)
    assert stats.loss > stats.aux_loss
    m = model()  # the same run, its bound placed between the second batch's auxiliary and network losses
    m.step(x[first], y[first], first)
    m.loss_reference = (stats.loss + stats.aux_loss) / 2 / m.divergence_loss_factor
    with pytest.raises(ADMMDivergenceError) as err:
        m.step(x[second], y[second], second)
    assert re.fullmatch(r"s \(t=\d\)|o", err.value.block)
