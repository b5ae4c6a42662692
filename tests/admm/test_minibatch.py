"""Mini-batch ADMMiRNN: with minibatch="carry" every sample's variables and duals live in a store indexed by sample
id and are carried from one batch to the next, so one batch holding the whole data set is the full-batch method bit
for bit; a shuffled epoch is the same whatever the thread count and resumes exactly from a state_dict; bad indices
and mode mix-ups raise naming the problem; minibatch="reinit" starts every batch at the forward pass."""
import io

import pytest
import torch
from fastdist.admm import ADMMiRNN
from fastdist.bench.report import torch_threads

F, H, O, T, N = 3, 6, 3, 4, 30


def data(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, T, F, generator=g, dtype=torch.float64).to(dtype)
    return x, torch.arange(N) % O


def same_state(a, b):
    for group in ("weights", "variables", "dual"):
        for k, v in getattr(a, group).items():
            assert torch.equal(v, getattr(b, group)[k]), f"{group}[{k}] differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_batch_of_the_whole_data_set_is_the_full_batch_method_bit_for_bit(dtype):
    x, y = data(dtype)
    full = ADMMiRNN(F, H, O, T, rho=2.0, dtype=dtype)
    mini = ADMMiRNN(F, H, O, T, rho=2.0, dtype=dtype, minibatch="carry", num_samples=N)
    for _ in range(4):
        assert mini.step(x, y, torch.arange(N)) == full.step(x, y)
    same_state(mini, full)
    assert bool(mini.seen.all())


def test_the_order_of_samples_in_a_batch_does_not_matter_beyond_rounding():
    x, y = data()
    full = ADMMiRNN(F, H, O, T, rho=2.0, dtype=torch.float64)
    mini = ADMMiRNN(F, H, O, T, rho=2.0, dtype=torch.float64, minibatch="carry", num_samples=N)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        a, b = full.step(x, y), mini.step(x[perm], y[perm], perm)
        assert b.lagrangian == pytest.approx(a.lagrangian, rel=1e-10)
    for k in BLOCKS_AND_WEIGHTS:
        torch.testing.assert_close(mini.weights[k], full.weights[k], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(mini.dual["a"], full.dual["a"], rtol=1e-9, atol=1e-12)


BLOCKS_AND_WEIGHTS = ("u", "w", "b", "v", "c")


def epoch_batches(seed=0, batch=8):
    return torch.randperm(N, generator=torch.Generator().manual_seed(seed)).split(batch)


def minibatch_run(model, x, y, epochs, first_epoch=0):
    stats = []
    for e in range(first_epoch, first_epoch + epochs):
        for idx in epoch_batches(e):
            stats.append(model.step(x[idx], y[idx], idx))
    return stats


def test_a_batch_changes_only_its_own_samples_variables_and_first_visits_start_at_the_forward_pass():
    x, y = data()
    m = ADMMiRNN(F, H, O, T, dtype=torch.float64, minibatch="carry", num_samples=N)
    idx = torch.tensor([3, 7, 11])
    m.step(x[idx], y[idx], idx)
    rest = torch.ones(N, dtype=torch.bool)
    rest[idx] = False
    assert m.seen.tolist() == (~rest).tolist()
    assert m.variables["a"][:, rest].abs().max() == 0 and m.dual["o"][rest].abs().max() == 0
    # a sample seen for the first time starts at the forward pass of the current weights, duals 0 (residuals 0)
    nxt = torch.tensor([0, 3])
    carried = m.variables["a"][:, 3].clone()
    want_fresh = m._forward(x[nxt].transpose(0, 1))[0][:, 0]
    variables, dual = m._gather(x[nxt].transpose(0, 1).contiguous(), nxt)
    torch.testing.assert_close(variables["a"][:, 0], want_fresh, rtol=0, atol=0)
    assert torch.equal(variables["a"][:, 1], carried) and dual["a"][:, 0].abs().max() == 0


def test_shuffled_mini_batch_epochs_are_the_same_at_one_and_two_threads():
    x, y = data(torch.float32)
    runs = []
    for threads in (1, 2):
        with torch_threads(threads):
            m = ADMMiRNN(F, H, O, T, rho=2.0, minibatch="carry", num_samples=N)
            runs.append((m, minibatch_run(m, x, y, 2)))
    (one, s1), (two, s2) = runs
    assert s1 == s2
    same_state(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mini_batch_training_resumes_from_a_state_dict_bit_for_bit(dtype):
    x, y = data(dtype)
    straight = ADMMiRNN(F, H, O, T, rho=2.0, dtype=dtype, minibatch="carry", num_samples=N)
    want = minibatch_run(straight, x, y, 2)
    first = ADMMiRNN(F, H, O, T, rho=2.0, dtype=dtype, minibatch="carry", num_samples=N)
    got = minibatch_run(first, x, y, 1)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = ADMMiRNN(F, H, O, T, rho=2.0, dtype=dtype, minibatch="carry", num_samples=N)
    resumed.load_state_dict(torch.load(buffer))
    got += minibatch_run(resumed, x, y, 1, first_epoch=1)
    assert got == want
    same_state(resumed, straight)
    assert torch.equal(resumed.seen, straight.seen)


def test_mini_batch_training_fits_labels_a_teacher_rnn_gives_on_the_whole_data_set():
    x, _ = data()
    y = ADMMiRNN(F, H, O, T, dtype=torch.float64, seed=7).forward(x).argmax(1)  # learnable by this network
    m = ADMMiRNN(F, H, O, T, rho=1.0, dtype=torch.float64, minibatch="carry", num_samples=N)
    start = m.loss_of(x, y)
    minibatch_run(m, x, y, 10)
    assert m.loss_of(x, y) < 0.5 * start


def test_reinit_starts_every_batch_at_the_forward_pass_with_zero_duals():
    x, y = data()
    full = ADMMiRNN(F, H, O, T, dtype=torch.float64)
    fresh = ADMMiRNN(F, H, O, T, dtype=torch.float64, minibatch="reinit")
    assert fresh.step(x, y) == full.step(x, y)  # the first sweep of either starts from the same state
    for batch in (7, 12):  # any batch size
        before = {k: v.clone() for k, v in fresh.weights.items()}
        stats = fresh.step(x[:batch], y[:batch])
        want = ADMMiRNN(F, H, O, T, dtype=torch.float64)
        want.weights = before
        assert stats.loss == pytest.approx(want.step(x[:batch], y[:batch]).loss, rel=0, abs=0)


def test_a_state_dict_of_another_mini_batch_mode_is_refused_naming_the_field():
    state = ADMMiRNN(F, H, O, T, minibatch="carry", num_samples=N).state_dict()
    with pytest.raises(ValueError, match="num_samples"):
        ADMMiRNN(F, H, O, T, minibatch="carry", num_samples=N + 1).load_state_dict(state)
    with pytest.raises(ValueError, match="minibatch"):
        ADMMiRNN(F, H, O, T).load_state_dict(state)
    older = ADMMiRNN(F, H, O, T).state_dict()  # a full-batch state saved before the mini-batch fields existed
    for key in ("minibatch", "num_samples"):
        del older["config"][key]
    del older["seen"]
    ADMMiRNN(F, H, O, T).load_state_dict(older)


@pytest.mark.parametrize("kwargs,match", [
    ({"minibatch": "online"}, "minibatch"), ({"minibatch": "carry"}, "num_samples"),
    ({"minibatch": "carry", "num_samples": 0}, "num_samples"), ({"num_samples": 10}, "num_samples"),
    ({"minibatch": "reinit", "num_samples": 10}, "num_samples"),
])
def test_mini_batch_settings_out_of_range_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ADMMiRNN(F, H, O, T, **kwargs)


def test_bad_indices_are_refused_with_a_clear_error_and_leave_the_state_alone():
    x, y = data(torch.float32)
    m = ADMMiRNN(F, H, O, T, minibatch="carry", num_samples=N)
    xb, yb = x[:4], y[:4]
    cases = [(None, TypeError, "needs index"), (torch.arange(3), ValueError, r"shape \[4\]"),
             (torch.arange(4).int(), ValueError, "int64"), (torch.tensor([0, 1, 2, N]), ValueError, "outside"),
             (torch.tensor([-1, 1, 2, 3]), ValueError, "outside"), (torch.tensor([0, 1, 1, 3]), ValueError, "twice")]
    for index, error, match in cases:
        with pytest.raises(error, match=match):
            m.step(xb, yb, index)
    assert m.sweeps == 0 and not bool(m.seen.any())
    with pytest.raises(ValueError, match="minibatch='carry' only"):
        ADMMiRNN(F, H, O, T).step(xb, yb, torch.arange(4))
    full = ADMMiRNN(F, H, O, T)
    full.step(xb, yb)
    with pytest.raises(ValueError, match="minibatch='carry'"):  # the full-batch error points to the modes
        full.step(x[:5], y[:5])
