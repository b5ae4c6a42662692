"""fastdist.ops.quantize4 / dequantize4 / qlinear / qlinear_grad_input: 4-bit block quantization against its definition
(and bitsandbytes' NF4, bit for bit), the fused linear against ``x @ dequantize4(...).T`` in float64."""
import pytest
import torch
from fastdist.ops import dequantize4, qlinear, qlinear_grad_input, quantize4
from op_testing import DEVICES, bad_input_tests

NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])


def weight(n, k, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(dtype)


def codes(packed):
    return torch.stack([packed >> 4, packed & 15], -1).reshape(packed.shape[0], -1).long()


def oracle_dequantize(w, scheme, block, block_rows=1):
    """The definition in float32 torch ops: per block absmax + nearest NF4 level, or min/max + round half even."""
    n, k = w.shape
    # [row blocks, groups, block_rows * block]
    b = w.float().reshape(n // block_rows, block_rows, k // block, block).transpose(1, 2).flatten(2)
    if scheme == "nf4":
        s = b.abs().amax(-1, keepdim=True)
        v = (b * (1.0 / s.clamp(min=1e-38))).clamp(-1, 1)
        q = torch.bucketize(v, (NF4[:-1] + NF4[1:]) / 2)
        out = NF4[q] * s
    else:
        lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
        scale = (hi - lo) / 15
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = torch.round((b - lo) * inv).clamp(0, 15)
        out = q * scale + lo
    return out.unflatten(2, (block_rows, block)).transpose(1, 2).reshape(n, k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", ["nf4", "int4"])
@pytest.mark.parametrize("shape, block", [((7, 64), 64), ((3, 192), 32), ((5, 10), 2), ((1, 4096), 64), ((0, 64), 64),
                                          ((4, 0), 64)])
def test_dequantized_weight_is_the_schemes_definition(device, scheme, shape, block):
    w = weight(*shape)
    packed, scales, zeros = quantize4(w.to(device), scheme, block)
    assert packed.shape == (shape[0], shape[1] // 2) and scales.shape == (shape[0], shape[1] // block)
    assert (zeros is None) == (scheme == "nf4")
    got = dequantize4(packed, scales, zeros, scheme).cpu()
    torch.testing.assert_close(got, oracle_dequantize(w, scheme, block), atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", ["nf4", "int4"])
@pytest.mark.parametrize("shape, block, block_rows", [((16, 32), 4, 8), ((6, 10), 2, 3), ((0, 8), 4, 8)])
def test_two_dimensional_blocks_share_a_scale_over_their_rows(device, scheme, shape, block, block_rows):
    w = weight(*shape, seed=9)
    packed, scales, zeros = quantize4(w.to(device), scheme, block, block_rows)
    assert scales.shape == (shape[0] // block_rows, shape[1] // block)
    got = dequantize4(packed, scales, zeros, scheme).cpu()
    torch.testing.assert_close(got, oracle_dequantize(w, scheme, block, block_rows), atol=0, rtol=0)
    for rows in (3, 40):
        x = torch.randn(rows, shape[1])
        torch.testing.assert_close(qlinear(x.to(device), packed, scales, zeros, scheme).cpu().double(),
                                   reference_linear(x, got, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(64, 256), (33, 128), (1, 64)])
def test_nf4_codes_and_absmax_equal_bitsandbytes_quantize_4bit_bit_for_bit(shape):
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    w = weight(*shape, seed=1)
    w[0, :5] = torch.tensor([0.0, -0.5, 0.5, 1e-30, -1e-30])  # ties, tiny values
    packed, scales, _ = quantize4(w, "nf4", 64)
    bnb_packed, state = bnb_functional.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert torch.equal(packed.flatten(), bnb_packed.flatten())
    assert torch.equal(scales.flatten(), state.absmax.flatten())
    bnb_w = bnb_functional.dequantize_4bit(bnb_packed, state)
    assert torch.equal(dequantize4(packed, scales, None, "nf4"), bnb_w)


def test_int4_error_is_within_half_a_step_and_constant_blocks_are_exact():
    w = weight(16, 128, seed=2)
    w[3] = 0.7  # a constant row
    packed, scales, zeros = quantize4(w, "int4", 32)
    got = dequantize4(packed, scales, zeros, "int4")
    step = scales.repeat_interleave(32, dim=1)
    assert ((got - w).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(got[3], w[3])
    assert torch.equal(zeros, w.reshape(16, 4, 32).amin(-1))


def test_bfloat16_weights_quantize_their_float32_image():
    w = weight(8, 64, dtype=torch.bfloat16)
    for scheme in ("nf4", "int4"):
        a, b = quantize4(w, scheme, 64), quantize4(w.float(), scheme, 64)
        assert all(x is None and y is None or torch.equal(x, y) for x, y in zip(a, b))


def reference_linear(x, w, bias):
    y = x.double() @ w.double().T
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", ["nf4", "int4"])
@pytest.mark.parametrize("x_shape", [(1, 128), (5, 128), (2, 3, 128), (40, 128), (0, 128), (3, 0, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_qlinear_equals_the_product_with_the_dequantized_weight(device, scheme, x_shape, with_bias):
    w = weight(37, 128, seed=3)
    packed, scales, zeros = quantize4(w.to(device), scheme, 64)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(x_shape, generator=g)
    bias = torch.randn(37, generator=g) if with_bias else None
    got = qlinear(x.to(device), packed, scales, zeros, scheme, bias.to(device) if with_bias else None)
    want = reference_linear(x, dequantize4(packed, scales, zeros, scheme).cpu(), bias)
    assert got.shape == (*x_shape[:-1], 37) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 16, 32, 33])  # both sides of the decode / tiled threshold
def test_qlinear_on_a_layer_with_odd_sizes_and_a_non_contiguous_input(rows):
    w = weight(19, 96, seed=5)
    packed, scales, zeros = quantize4(w, "int4", 6)
    x = torch.randn(96, rows).T  # non-contiguous
    got = qlinear(x, packed, scales, zeros, "int4")
    torch.testing.assert_close(got.double(), reference_linear(x, dequantize4(packed, scales, zeros, "int4"), None),
                               atol=1e-5, rtol=1e-5)


def test_qlinear_with_bfloat16_input_returns_bfloat16_of_the_float32_result():
    w = weight(32, 64)
    packed, scales, _ = quantize4(w, "nf4", 64)
    x = torch.randn(3, 64).to(torch.bfloat16)
    got = qlinear(x, packed, scales, None, "nf4")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, qlinear(x.float(), packed, scales, None, "nf4").to(torch.bfloat16), atol=0, rtol=0)


@pytest.mark.parametrize("rows", [1, 4, 16])  # codes decoded into registers (up to 4 rows), or through a buffer
def test_qlinear_results_do_not_depend_on_the_thread_count(rows):
    w = weight(512, 256, seed=6)
    packed, scales, zeros = quantize4(w, "int4", 64)
    x = torch.randn(rows, 256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qlinear(x, packed, scales, zeros, "int4")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, qlinear(x, packed, scales, zeros, "int4"))


@pytest.mark.parametrize("scheme, block, k", [("nf4", 64, 576), ("int4", 4, 296), ("nf4", 6, 294), ("int4", 96, 576)])
def test_a_row_of_x_gives_the_same_bits_alone_or_among_up_to_32_rows(scheme, block, k):
    # 1-4 rows decode the codes straight into registers, 5-32 through a buffer of decoded rows: one summation order
    # (k = 294 and 296 end in a partial group of 32 columns)
    w = weight(40, k, seed=10)
    packed, scales, zeros = quantize4(w, scheme, block)
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(11))
    together = qlinear(x, packed, scales, zeros, scheme)
    for rows in (1, 2, 4, 5, 17):
        assert torch.equal(qlinear(x[:rows], packed, scales, zeros, scheme), together[:rows]), rows


@pytest.mark.parametrize("scheme, block, block_rows", [("nf4", 64, 1), ("int4", 4, 8), ("int4", 2, 1), ("nf4", 8, 2)])
def test_tiled_forward_and_x_gradient_equal_the_products_and_do_not_depend_on_the_thread_count(scheme, block,
                                                                                               block_rows):
    # 40 rows of x take the dequantized tiles and the BLAS; narrow and 2-D blocks the vectorized decode
    w = weight(48, 256, seed=8)
    packed, scales, zeros = quantize4(w, scheme, block, block_rows)
    g = torch.Generator().manual_seed(9)
    x, grad = torch.randn(40, 256, generator=g), torch.randn(40, 48, generator=g)
    wq = dequantize4(packed, scales, zeros, scheme)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qlinear(x, packed, scales, zeros, scheme), qlinear_grad_input(grad, packed, scales, zeros, scheme)
    finally:
        torch.set_num_threads(threads)
    many = qlinear(x, packed, scales, zeros, scheme), qlinear_grad_input(grad, packed, scales, zeros, scheme)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])
    torch.testing.assert_close(many[0].double(), reference_linear(x, wq, None), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(many[1].double(), grad.double() @ wq.double(), atol=1e-5, rtol=1e-5)


def test_a_weight_of_several_tiles_gives_the_products():
    # 1100 x 4096 float32 is more than one 16 MiB tile: 1024 output rows, then 76
    w = weight(1100, 4096, seed=10)
    packed, scales, zeros = quantize4(w, "int4", 32)
    g = torch.Generator().manual_seed(11)
    x, grad, bias = torch.randn(40, 4096, generator=g), torch.randn(40, 1100, generator=g), torch.randn(1100)
    wq = dequantize4(packed, scales, zeros, "int4").double()
    torch.testing.assert_close(qlinear(x, packed, scales, zeros, "int4", bias).double(),
                               reference_linear(x, wq, bias), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(qlinear_grad_input(grad, packed, scales, zeros, "int4").double(), grad.double() @ wq,
                               atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("scheme", ["nf4", "int4"])
@pytest.mark.parametrize("rows", [2, 40])
@pytest.mark.filterwarnings("ignore:Input #.* is not a double precision")
def test_gradcheck_with_respect_to_x_and_bias(scheme, rows):
    w = weight(6, 8, seed=7)
    packed, scales, zeros = quantize4(w, scheme, 4)
    x = torch.randn(rows, 8, dtype=torch.float32, requires_grad=True)
    bias = torch.randn(6, requires_grad=True)
    # float32 op: a loose finite-difference check, then the exact gradient against the dequantized weight
    assert torch.autograd.gradcheck(lambda a, b: qlinear(a, packed, scales, zeros, scheme, b), (x, bias), eps=1e-2,
                                    atol=1e-2, rtol=1e-2)
    grad = torch.randn(rows, 6)
    qlinear(x, packed, scales, zeros, scheme, bias).backward(grad)
    torch.testing.assert_close(x.grad, grad @ dequantize4(packed, scales, zeros, scheme))
    torch.testing.assert_close(bias.grad, grad.sum(0))
    torch.testing.assert_close(qlinear_grad_input(grad, packed, scales, zeros, scheme),
                               grad @ dequantize4(packed, scales, zeros, scheme))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    w = weight(24, 64).to(device)
    for scheme in ("nf4", "int4"):
        packed, scales, zeros = quantize4(w, scheme, 32)
        torch.library.opcheck(torch.ops.fastdist.quant4_quantize.default, (w, scheme, 32))
        torch.library.opcheck(torch.ops.fastdist.quant4_dequantize.default, (packed, scales, zeros, scheme))
        for rows in (3, 40):
            x = torch.randn(rows, 64, device=device, requires_grad=True)
            bias = torch.randn(24, device=device, requires_grad=True)
            torch.library.opcheck(torch.ops.fastdist.qlinear.default, (x, packed, scales, zeros, scheme, bias))
            torch.library.opcheck(torch.ops.fastdist.qlinear.default, (x, packed, scales, zeros, scheme, None))
            grad = torch.randn(rows, 24, device=device)
            torch.library.opcheck(torch.ops.fastdist.qlinear_grad_input.default, (grad, packed, scales, zeros, scheme))


def test_qlinear_compiles_with_fullgraph():
    packed, scales, zeros = quantize4(weight(16, 64), "int4", 32)
    f = torch.compile(lambda x: qlinear(x, packed, scales, zeros, "int4").relu(), fullgraph=True, backend="eager")
    x = torch.randn(3, 64)
    torch.testing.assert_close(f(x), qlinear(x, packed, scales, zeros, "int4").relu())


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["nf4", "int4"])
@pytest.mark.parametrize("rows", [1, 16, 17])
def test_cuda_quantization_is_bit_identical_to_cpu_and_qlinear_close(scheme, rows):
    w = weight(64, 256, seed=8)
    cpu = quantize4(w, scheme, 64)
    gpu = quantize4(w.cuda(), scheme, 64)
    for a, b in zip(cpu, gpu):
        assert (a is None and b is None) or torch.equal(a, b.cpu())
    x = torch.randn(rows, 256)
    torch.testing.assert_close(qlinear(x.cuda(), *gpu, scheme).cpu(), qlinear(x, *cpu, scheme), atol=1e-5, rtol=1e-5)


def _q(device, scheme="int4", n=4, k=8, block=4):
    return quantize4(weight(n, k).to(device), scheme, block)


BAD_INPUTS = {
    "unknown scheme": (lambda d: quantize4(weight(2, 8).to(d), "fp4", 4), r"'scheme' must be \"nf4\" or \"int4\""),
    "odd block": (lambda d: quantize4(weight(2, 9).to(d), "nf4", 3), r"'block' must be even and >= 2, got 3"),
    "block not dividing k": (lambda d: quantize4(weight(2, 12).to(d), "nf4", 8),
                             r"'block' must divide the input dimension"),
    "block_rows not dividing n": (lambda d: quantize4(weight(6, 8).to(d), "int4", 4, 4),
                                  r"'block_rows' must divide the output dimension"),
    "1-d weight": (lambda d: quantize4(torch.zeros(8, device=d), "nf4", 4), r"'w' must have 2 dimension"),
    "integer weight": (lambda d: quantize4(torch.zeros(2, 8, dtype=torch.int32, device=d), "nf4", 4),
                       r"'w' must have dtype torch.float32, torch.float16 or torch.bfloat16, got torch.int32"),
    "x of the wrong width": (lambda d: qlinear(torch.zeros(2, 6, device=d), *_q(d), "int4"),
                             r"'x' must have last dimension 8"),
    "int4 without zeros": (lambda d: qlinear(torch.zeros(2, 8, device=d), *_q(d)[:2], None, "int4"),
                           r"'zeros' must be given for scheme \"int4\""),
    "nf4 with zeros": (lambda d: qlinear(torch.zeros(2, 8, device=d), *_q(d)[:2], _q(d)[2], "nf4"),
                       r"'zeros' must be None for scheme \"nf4\""),
    "scales of the wrong shape": (lambda d: dequantize4(_q(d)[0], torch.zeros(4, 3, device=d), None, "nf4"),
                                  r"'scales' must have shape \[n / block_rows, k / block\]"),
    "packed not uint8": (lambda d: dequantize4(torch.zeros(4, 4, device=d), torch.zeros(4, 2, device=d), None, "nf4"),
                         r"'packed' must have dtype torch.uint8"),
    "bias of the wrong shape": (lambda d: qlinear(torch.zeros(2, 8, device=d), *_q(d), "int4",
                                                  torch.zeros(5, device=d)), r"'bias' must have shape \[4\]"),
    "grad of the wrong width": (lambda d: qlinear_grad_input(torch.zeros(2, 5, device=d), *_q(d), "int4"),
                                r"'grad' must have last dimension 4"),
}

test_bad_inputs_raise_a_clear_error, test_fake_kernels_reject_bad_inputs_like_the_real_ones = \
    bad_input_tests(BAD_INPUTS)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(bad):
    w = weight(4, 8)
    w[2, 3] = bad
    with pytest.raises(RuntimeError, match=r"'w' must be finite: 1 of 8 block\(s\)"):
        quantize4(w, "nf4", 4)
