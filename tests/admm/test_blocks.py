"""Each block update of an ADMMiRNN sweep minimises the augmented Lagrangian L in its own variable: the closed-form
blocks (c, v, s_t, b, w, u; o under mse) land where autograd's gradient of L in that block is zero, the linearised
blocks (o under cross-entropy, a_t) decrease L and, repeated, reach the minimiser autograd finds; the dual step
adds +rho * residual; the trained weights run unchanged in torch.nn.RNN + nn.Linear."""
import pytest
import torch
from fastdist.admm import ADMMiRNN, RNNClassifier

F, H, O, T, B = 3, 5, 4, 4, 12


def problem(loss="cross_entropy", seed=0, duals="all", **kw):
    """A float64 ADMMiRNN after three sweeps (so the duals are non-zero) and its batch (time-major xt too)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, F, generator=g, dtype=torch.float64)
    if loss == "mse":
        y = torch.randn(B, O, generator=g, dtype=torch.float64)
    else:
        y = torch.randint(0, O, (B,), generator=g)
    m = ADMMiRNN(F, H, O, T, rho={"a": 0.7, "s": 1.3, "o": 0.9}, loss=loss, duals=duals, dtype=torch.float64,
                 seed=seed, **kw)
    for _ in range(3):
        m.step(x, y)
    return m, x.transpose(0, 1).contiguous(), y


def block_tensor(m, block, t):
    """The tensor holding `block` (a view of the time slice for s and a)."""
    if block in ("a", "s"):
        return m.variables[block][t]
    if block == "o":
        return m.variables["o"]
    return m.weights[block]


def set_block(m, block, t, value):
    if block in ("a", "s"):  # out of place: value may carry autograd's graph
        full = m.variables[block]
        m.variables[block] = torch.cat([full[:t], value.unsqueeze(0), full[t + 1:]])
    elif block == "o":
        m.variables["o"] = value
    else:
        m.weights[block] = value


def grad_of_L(m, xt, y, block, t):
    """dL/d(block) at the current state, by autograd."""
    leaf = block_tensor(m, block, t).detach().clone().requires_grad_(True)
    saved = dict(m.variables), dict(m.weights)
    set_block(m, block, t, leaf)
    (grad,) = torch.autograd.grad(m.lagrangian(xt, y), leaf)
    m.variables, m.weights = saved
    return grad


CLOSED_FORM = [("c", None), ("v", None), ("s", 3), ("s", 1), ("s", 0), ("b", None), ("w", None), ("u", None)]


@pytest.mark.parametrize("block,t", CLOSED_FORM)
def test_a_closed_form_block_update_lands_at_the_minimiser_of_L_in_that_block(block, t):
    m, xt, y = problem(weight_decay=0.01)
    m.damping = 1e-12  # the proximal term pulls toward the old value; without it the update is the exact minimiser
    before = float(m.lagrangian(xt, y))
    m._update(block, xt, y, t)
    after = float(m.lagrangian(xt, y))
    assert after < before
    grad = grad_of_L(m, xt, y, block, t)
    assert grad.abs().max() < 1e-8, f"{block}: |dL/d{block}| = {grad.abs().max():.2e} after its update"


def test_the_o_update_under_mse_is_the_exact_minimiser():
    m, xt, y = problem(loss="mse")
    m._update("o", xt, y)
    assert grad_of_L(m, xt, y, "o", None).abs().max() < 1e-10


@pytest.mark.parametrize("block,t", [("o", None), ("a", 3), ("a", 0)])
def test_a_linearised_block_update_decreases_L_and_repeated_reaches_the_autograd_minimiser(block, t):
    m, xt, y = problem()
    start = block_tensor(m, block, t).clone()
    values = [float(m.lagrangian(xt, y))]
    for _ in range(100):
        m._update(block, xt, y, t)
        values.append(float(m.lagrangian(xt, y)))
    assert all(b <= a + 1e-12 for a, b in zip(values, values[1:])), "L rose after a linearised update"
    assert values[1] < values[0]
    assert grad_of_L(m, xt, y, block, t).abs().max() < 1e-6  # a stationary point of L in the block
    # autograd's own minimisation of L in the block from the same start lands at the same value
    fixed_point = block_tensor(m, block, t).clone()
    leaf = start.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([leaf], max_iter=200, tolerance_grad=1e-12, tolerance_change=1e-15,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        set_block(m, block, t, leaf)
        value = m.lagrangian(xt, y)
        value.backward()
        return value

    opt.step(closure)
    torch.testing.assert_close(fixed_point, leaf.detach(), atol=1e-6, rtol=0)


def test_the_dual_step_adds_rho_times_the_residual_of_the_primal_updates():
    m, xt, y = problem()
    before = {k: v.clone() for k, v in m.dual.items()}
    m.step(xt.transpose(0, 1), y)
    r = m.residual_tensors(xt)  # the dual step leaves the primal variables alone
    for k in ("a", "s", "o"):
        torch.testing.assert_close(m.dual[k] - before[k], m.rho[k] * r[k], atol=1e-12, rtol=0)
        assert float((m.dual[k] - before[k]).flatten() @ r[k].flatten()) > 0  # ascent: along +residual


def test_with_duals_last_only_the_last_steps_constraints_carry_duals():
    m, xt, y = problem(duals="last")
    assert m.dual["a"][:-1].abs().max() == 0 and m.dual["s"][:-1].abs().max() == 0
    assert m.dual["a"][-1].abs().max() > 0 and m.dual["o"].abs().max() > 0


def test_model_returns_torch_rnn_and_linear_whose_outputs_equal_the_admm_forward():
    m, xt, y = problem()
    x = xt.transpose(0, 1)
    net = m.model()
    assert isinstance(net, RNNClassifier) and isinstance(net.rnn, torch.nn.RNN)
    assert net.rnn.nonlinearity == "tanh" and net.rnn.batch_first
    with torch.no_grad():
        torch.testing.assert_close(net(x), m.forward(x), atol=1e-12, rtol=1e-12)
    # at the start (before any sweep) the auxiliary variables are the forward pass: every residual is exactly 0
    fresh = ADMMiRNN(F, H, O, T, dtype=torch.float64)
    fresh._bind(xt)
    assert all(float(r.abs().max()) < 1e-12 for r in fresh.residual_tensors(xt).values())


def test_the_sweep_reports_the_forward_loss_the_auxiliary_loss_and_L():
    m, xt, y = problem()
    x = xt.transpose(0, 1)
    stats = m.step(x, y)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(m.model()(x), y)
    assert stats.loss == pytest.approx(want.item(), rel=1e-10)
    assert stats.sweep == 4 and set(stats.residuals) == {"a", "s", "o"}
