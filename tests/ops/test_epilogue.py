"""fastdist.ops.bias_epilogue / bias_epilogue_backward: act(x + bias) + residual and its gradient, against torch's
own elementwise ops computed in float64 (float32 for the 16-bit dtypes, rounded once, as the op specifies)."""
import pytest
import torch
import torch.nn.functional as F
from fastdist.ops import bias_epilogue, bias_epilogue_backward
from op_testing import DEVICES, bad_input_tests, huge

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
ACTIVATIONS = ["none", "gelu_tanh", "gelu_erf"]
SHAPES = [(0, 5), (5, 0), (1, 1), (7, 257), (3, 4, 33), (2, 1000)]


def torch_act(u, activation):
    if activation == "gelu_tanh":
        return F.gelu(u, approximate="tanh")
    if activation == "gelu_erf":
        return F.gelu(u)
    return u


def compute_dtype(dtype):
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def oracle(x, bias, residual, activation):
    """The op's definition evaluated by torch: widened inputs, one rounding to x's dtype at the end."""
    c = compute_dtype(x.dtype)
    u = x.cpu().to(c)
    if bias is not None:
        u = u + bias.cpu().to(c)
    u = torch_act(u, activation)
    if residual is not None:
        u = u + residual.cpu().to(c)
    return u


def tolerance(dtype):
    # float32: the rational tanh/erf are within 5e-7 of exact; 16-bit: the float32 result rounds once, so at most
    # one unit in the last place of the dtype (plus the float32 approximation's error near a rounding boundary).
    return {torch.float64: (1e-12, 1e-12), torch.float32: (2e-6, 2e-6), torch.float16: (1e-3, 2**-10),
            torch.bfloat16: (1e-2, 2**-7)}[dtype]


def assert_matches(got, want, dtype):
    atol, rtol = tolerance(dtype)
    assert got.dtype == dtype
    assert got.shape == want.shape
    torch.testing.assert_close(got.cpu().to(want.dtype), want, atol=atol, rtol=rtol)


def make_inputs(shape, dtype, device, with_bias, with_residual, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
    bias = torch.randn(shape[-1], generator=g).to(dtype).to(device) if with_bias else None
    residual = torch.randn(shape, generator=g).to(dtype).to(device) if with_residual else None
    return x, bias, residual


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_bias, with_residual", [(True, True), (True, False), (False, True), (False, False)])
def test_epilogue_equals_act_of_x_plus_bias_plus_residual(device, dtype, activation, with_bias, with_residual):
    for shape in SHAPES:
        x, bias, residual = make_inputs(shape, dtype, device, with_bias, with_residual)
        out = bias_epilogue(x, bias, residual, activation)
        assert out.device == x.device and out.is_contiguous()
        assert_matches(out, oracle(x, bias, residual, activation), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_epilogue_reads_non_contiguous_inputs(device, activation):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 66, generator=g).to(device)[::2, 1:-1]
    residual = torch.randn(64, 20, generator=g).to(device).t()
    bias = torch.randn(128, generator=g).to(device)[::2]
    assert not (x.is_contiguous() or residual.is_contiguous() or bias.is_contiguous())
    assert_matches(bias_epilogue(x, bias, residual, activation), oracle(x, bias, residual, activation), torch.float32)


@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu_erf"])
def test_float32_gelu_is_within_a_few_ulp_of_exact_over_a_wide_range(activation):
    u = torch.cat([torch.linspace(-12, 12, 200_001), torch.tensor([-1e4, -300.0, -1e-30, 0.0, 1e-30, 300.0, 1e4])])
    got = bias_epilogue(u.reshape(1, -1), activation=activation).flatten().double()
    want = torch_act(u.double(), activation)
    err = (got - want).abs()
    assert (err <= 1e-6 * want.abs().clamp(min=1.0) + 1e-6 * u.double().abs() * 1e-1).all(), err.max()


EXTREMES = [float("-inf"), -3.4e38, -1e38, -1e20, -1e19, -1e13, -1e6, -1e4, -100.0, -11.0, -10.0, -5.0, -1e-30, 0.0,
            1e-30, 5.0, 100.0, 1e4, 1e6, 1e13, 1e20, 1e38, 3.4e38, float("inf"), float("nan")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu_erf"])
def test_gelu_and_its_gradient_saturate_like_torch_at_extreme_inputs(device, dtype, activation):
    # torch's own float64 GeLU of the same (dtype-rounded) values, which overflows nowhere in this range: ours may
    # not overflow either (0.044715 u^3 and u^2 do in float32), and infinities and NaN give what torch gives.
    x = torch.tensor(EXTREMES).to(dtype)
    u = x.double().requires_grad_()
    torch_act(u, activation).backward(torch.ones_like(u))
    got = bias_epilogue(x.reshape(1, -1).to(device), activation=activation).cpu().flatten()
    grad = bias_epilogue_backward(torch.ones_like(x).reshape(1, -1).to(device), x.reshape(1, -1).to(device),
                                  activation=activation).cpu().flatten()
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(got.double(), torch_act(u.detach(), activation).to(dtype).double(), atol=atol, rtol=rtol,
                               equal_nan=True)
    torch.testing.assert_close(grad.double(), u.grad.to(dtype).double(), atol=atol, rtol=rtol, equal_nan=True)


def test_float64_gelu_tanh_saturates_where_its_cube_would_overflow():
    x = torch.tensor([[-1e300, -1e160, -1e103, 1e103, 1e160, 1e300]], dtype=torch.float64)
    assert bias_epilogue(x, activation="gelu_tanh").tolist() == [[-0.0, -0.0, -0.0, 1e103, 1e160, 1e300]]
    assert bias_epilogue_backward(torch.ones_like(x), x, activation="gelu_tanh").tolist() == [[0, 0, 0, 1, 1, 1]]


def test_epilogue_propagates_nan():
    x = torch.tensor([[float("nan"), 1.0, -2.0]])
    for activation in ACTIVATIONS:
        out = bias_epilogue(x, torch.zeros(3), None, activation)
        assert out[0, 0].isnan() and not out[0, 1:].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_results_are_the_float32_result_rounded_to_nearest_even(dtype):
    # With activation "none" the float32 arithmetic is exact enough to compare bits: torch's .to(dtype) is RNE.
    x, bias, residual = make_inputs((64, 300), dtype, "cpu", True, True, seed=5)
    want = ((x.float() + bias.float()) + residual.float()).to(dtype)
    assert torch.equal(bias_epilogue(x, bias, residual, "none"), want)
    # Every float32 rounding case, including ties, subnormals, overflow to infinity and NaN.
    specials = torch.tensor([65504.0, 65520.0, 65519.99, 1e6, -1e6, 6e-8, 3e-8, 2.9e-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11,
                             float("inf"), float("-inf"), 3.4e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1e-40])
    got = bias_epilogue(specials.reshape(1, -1).to(torch.float32), None, None, "none")  # float32 passes through
    assert torch.equal(got, specials.reshape(1, -1))
    wide = torch.zeros(1, specials.numel(), dtype=dtype)
    exact = bias_epilogue(wide, None, specials.reshape(1, -1).to(dtype), "none")
    assert torch.equal(exact, specials.reshape(1, -1).to(dtype))


def test_16_bit_rounding_of_float32_values_matches_torch():
    # 0 + residual with a float32 gelu in between exercises the float32 -> 16-bit store on many values.
    g = torch.Generator().manual_seed(11)
    u = torch.randn(1, 100_000, generator=g) * 100
    for dtype in (torch.float16, torch.bfloat16):
        got = bias_epilogue(u.to(dtype), None, None, "none")
        assert torch.equal(got, u.to(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_backward_equals_grad_times_activation_derivative(device, dtype, activation):
    x, bias, _ = make_inputs((9, 301), dtype, device, True, False, seed=7)
    grad = make_inputs((9, 301), dtype, device, False, False, seed=8)[0]
    c = compute_dtype(dtype)
    for b in (bias, None):
        u = x.cpu().to(c) + (b.cpu().to(c) if b is not None else 0)
        u.requires_grad_()
        (torch_act(u, activation) * grad.cpu().to(c)).sum().backward()
        assert_matches(bias_epilogue_backward(grad, x, b, activation), u.grad, dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_bias, with_residual", [(True, True), (False, False), (True, False)])
def test_gradcheck(activation, with_bias, with_residual):
    x, bias, residual = make_inputs((4, 7), torch.float64, "cpu", with_bias, with_residual, seed=2)
    inputs = [t.requires_grad_() if t is not None else None for t in (x, bias, residual)]
    assert torch.autograd.gradcheck(lambda a, b, r: bias_epilogue(a, b, r, activation), inputs)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_autograd_gradients_equal_torch_reference_for_3d_input(activation):
    x, bias, residual = make_inputs((2, 5, 64), torch.float32, "cpu", True, True, seed=4)
    mine = [t.clone().requires_grad_() for t in (x, bias, residual)]
    ref = [t.double().requires_grad_() for t in (x, bias, residual)]
    weight = torch.randn(2, 5, 64)
    (bias_epilogue(*mine, activation) * weight).sum().backward()
    ((torch_act(ref[0] + ref[1], activation) + ref[2]) * weight.double()).sum().backward()
    for m, r in zip(mine, ref):
        torch.testing.assert_close(m.grad.double(), r.grad, atol=2e-5, rtol=2e-5)


def test_results_do_not_depend_on_the_thread_count():
    x, bias, residual = make_inputs((512, 1031), torch.bfloat16, "cpu", True, True, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = bias_epilogue(x, bias, residual, "gelu_tanh"), bias_epilogue_backward(residual, x, bias, "gelu_erf")
        torch.set_num_threads(max(2, threads))
        many = bias_epilogue(x, bias, residual, "gelu_tanh"), bias_epilogue_backward(residual, x, bias, "gelu_erf")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_bias_epilogue(device):
    for dtype in (torch.float32, torch.bfloat16):
        for activation in ACTIVATIONS:
            for with_bias, with_residual in [(True, True), (False, False)]:
                x, bias, residual = make_inputs((6, 17), dtype, device, with_bias, with_residual)
                args = (x.requires_grad_(dtype == torch.float32), bias, residual, activation)
                torch.library.opcheck(torch.ops.fastdist.bias_epilogue.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_bias_epilogue_backward(device):
    for activation in ACTIVATIONS:
        x, bias, grad = make_inputs((6, 17), torch.float32, device, True, True)
        torch.library.opcheck(torch.ops.fastdist.bias_epilogue_backward.default, (grad, x, bias, activation))
        torch.library.opcheck(torch.ops.fastdist.bias_epilogue_backward.default, (grad, x, None, activation))


@pytest.mark.parametrize("device", DEVICES)
def test_epilogue_compiles_with_fullgraph(device):
    def block_tail(x, bias, residual):
        return bias_epilogue(x, bias, residual, "gelu_tanh") * 2

    x, bias, residual = make_inputs((8, 32), torch.float32, device, True, True)
    compiled = torch.compile(block_tail, fullgraph=True)
    torch.testing.assert_close(compiled(x, bias, residual), block_tail(x, bias, residual))


# ---- bad inputs ----

def _x(d, dtype=torch.float32):
    return torch.ones(4, 3, dtype=dtype, device=d)


BAD_INPUTS = {
    "int_x": (lambda d: bias_epilogue(_x(d, torch.int32)),
              r"'x' must have a floating dtype \(torch.float32, torch.float16, torch.bfloat16 or torch.float64\), "
              r"got torch.int32"),
    "0d_x": (lambda d: bias_epilogue(torch.tensor(1.0, device=d)),
             r"'x' must have at least 1 dimension\(s\), got shape \[\]"),
    "bias_dtype": (lambda d: bias_epilogue(_x(d), torch.ones(3, dtype=torch.float64, device=d)),
                   r"'bias' must have the dtype of 'x' \(torch.float32\), got torch.float64"),
    "bias_length": (lambda d: bias_epilogue(_x(d), torch.ones(4, device=d)),
                    r"'bias' must have shape \[3\] \(the last dimension of 'x'\), got shape \[4\]"),
    "bias_2d": (lambda d: bias_epilogue(_x(d), torch.ones(1, 3, device=d)),
                r"'bias' must have shape \[3\] \(the last dimension of 'x'\), got shape \[1, 3\]"),
    "residual_shape": (lambda d: bias_epilogue(_x(d), None, torch.ones(3, device=d)),
                       r"'residual' must have the shape of 'x' \(\[4, 3\]\), got shape \[3\]"),
    "residual_dtype": (lambda d: bias_epilogue(_x(d), None, _x(d, torch.bfloat16)),
                       r"'residual' must have the dtype of 'x' \(torch.float32\), got torch.bfloat16"),
    "activation": (lambda d: bias_epilogue(_x(d), activation="relu"),
                   "'activation' must be \"none\", \"gelu_tanh\" or \"gelu_erf\", got \"relu\""),
    "grad_shape": (lambda d: bias_epilogue_backward(torch.ones(4, 4, device=d), _x(d), None, "gelu_tanh"),
                   r"'grad' must have the shape of 'x' \(\[4, 3\]\), got shape \[4, 4\]"),
    "grad_dtype": (lambda d: bias_epilogue_backward(_x(d, torch.float16), _x(d), None, "gelu_tanh"),
                   r"'grad' must have the dtype of 'x' \(torch.float32\), got torch.float16"),
    "backward_activation": (lambda d: bias_epilogue_backward(_x(d), _x(d), None, "tanh"),
                            "'activation' must be \"none\", \"gelu_tanh\" or \"gelu_erf\", got \"tanh\""),
    "output_past_int64": (lambda d: bias_epilogue(huge([0, 2**62, 4], device=d)),
                          r"the output would have shape \[0, 4611686018427387904, 4\] of torch.float32: its strides "
                          r"or its size in bytes pass int64"),
}


test_bad_inputs_raise_a_clear_error, test_fake_kernels_reject_bad_inputs_like_the_real_ones = \
    bad_input_tests(BAD_INPUTS)


@pytest.mark.cuda
def test_bias_on_another_device_is_rejected():
    with pytest.raises(RuntimeError, match="'bias' and 'x' must be on the same device"):
        bias_epilogue(torch.ones(4, 3, device="cuda"), torch.ones(3))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_agrees_with_cpu(dtype):
    for activation in ACTIVATIONS:
        x, bias, residual = make_inputs((33, 517), dtype, "cpu", True, True, seed=12)
        cpu = bias_epilogue(x, bias, residual, activation)
        cuda = bias_epilogue(x.cuda(), bias.cuda(), residual.cuda(), activation)
        atol, rtol = tolerance(dtype)
        torch.testing.assert_close(cuda.cpu(), cpu, atol=atol, rtol=rtol)
