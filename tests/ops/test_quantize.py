"""fastdist.ops.quantize / dequantize: the schemes' error bounds (property-style, hypothesis), an independent numpy
oracle of the codes and the packing, unbiased stochastic rounding, determinism, and bad inputs."""
import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from fastdist.ops import dequantize, quantize
from hypothesis import given, settings
from op_testing import DEVICES, bad_input_tests, huge

BITS = [1, 2, 4, 8]
SCHEMES = ["minmax", "absmax"]


def oracle_codes(x, bits, scheme, group):
    """Nearest-rounding codes from the definition, in float32 numpy (same operation order as the kernels)."""
    v = x.detach().cpu().float().numpy().reshape(-1, group)
    f = np.float32
    if scheme == "minmax":
        lo, hi = v.min(1), v.max(1)
        scale = ((hi - lo) / f(2**bits - 1)).astype(f)
        offset, centre, qmin = lo, f(0), 0
    else:
        s = np.abs(v).max(1)
        scale = (f(2) * s if bits == 1 else s / f(2 ** (bits - 1) - 1)).astype(f)
        offset, centre, qmin = np.zeros_like(s), f(0.5 if bits == 1 else 2 ** (bits - 1)), 0 if bits == 1 else 1
    with np.errstate(divide="ignore"):
        inv = np.where(scale > 0, f(1) / scale, f(0)).astype(f)
    t = ((v - offset[:, None]) * inv[:, None] + centre).astype(f)
    q = np.clip(np.rint(t), qmin, 2**bits - 1).astype(np.uint8)
    return q.reshape(-1), scale


def oracle_pack(codes, bits):
    per = 8 // bits
    padded = np.zeros(-(-len(codes) // per) * per, dtype=np.uint32)
    padded[:len(codes)] = codes
    shifts = (np.arange(per) * bits).astype(np.uint32)
    return (padded.reshape(-1, per) << shifts).sum(1).astype(np.uint8)


def unpack_codes(packed, bits, n):
    per = 8 // bits
    p = packed.cpu().numpy().astype(np.uint32)
    return ((p[:, None] >> (np.arange(per) * bits)) & (2**bits - 1)).reshape(-1)[:n].astype(np.uint8)


def scale_bound(scale, group, n):
    return torch.from_numpy(np.repeat(scale.cpu().numpy(), group))[:n]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape, group", [((7, 13), 13), ((7, 13), 91), ((4, 64), 16), ((1,), 1), ((5, 3), 1)])
def test_codes_and_packing_match_the_numpy_oracle(device, bits, scheme, shape, group):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(bits + group))
    packed, scales, zeros = quantize(x.to(device), bits, scheme, group)
    codes, scale = oracle_codes(x, bits, scheme, group)
    assert np.array_equal(scales.cpu().numpy(), scale)
    assert np.array_equal(unpack_codes(packed, bits, x.numel()), codes)
    assert np.array_equal(packed.cpu().numpy(), oracle_pack(codes, bits))
    if scheme == "absmax":
        assert (zeros == 0).all()


@settings(max_examples=80, deadline=None)
@given(bits=st.sampled_from(BITS), scheme=st.sampled_from(SCHEMES), rows=st.integers(1, 6), d=st.integers(1, 70),
       per=st.sampled_from(["tensor", "row", "group"]), magnitude=st.floats(1e-6, 1e6), seed=st.integers(0, 2**31),
       stochastic=st.booleans())
def test_dequantized_error_is_within_the_schemes_bound(bits, scheme, rows, d, per, magnitude, seed, stochastic):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, d, generator=g) * magnitude).float()
    group = {"tensor": rows * d, "row": d, "group": next(s for s in (5, 3, 2, 1) if d % s == 0)}[per]
    packed, scales, zeros = quantize(x, bits, scheme, group, stochastic=stochastic, seed=seed)
    y = dequantize(packed, scales, zeros, bits, scheme, group, x.shape)
    err = (y - x).abs().reshape(-1)
    bound = scale_bound(scales, group, x.numel()) * (1.0 if stochastic else 0.5)
    # float32 rounding of (x - lo) * inv and of zero + q * scale: a few ulps of the group's magnitude
    slack = 4e-6 * x.abs().reshape(-1, group).amax(1).repeat_interleave(group)
    if stochastic:
        assert (err < bound + slack).all()
    else:
        assert (err <= bound + slack).all()
    if bits == 8 and not stochastic:  # the headline bound: 8-bit minmax error <= range / 510
        rng = (x.reshape(-1, group).amax(1) - x.reshape(-1, group).amin(1)).repeat_interleave(group)
        if scheme == "minmax":
            assert (err <= rng / 510 + slack).all()


@pytest.mark.parametrize("bits", BITS)
def test_minmax_constant_groups_and_all_zero_groups_come_back_exactly(bits):
    x = torch.tensor([[2.5] * 8, [0.0] * 8, [-1.0] * 8])
    for scheme in SCHEMES:
        packed, scales, zeros = quantize(x, bits, scheme, 8)
        y = dequantize(packed, scales, zeros, bits, scheme, 8, x.shape)
        assert torch.equal(y[1].abs(), x[1])  # all-zero: exact under both schemes (scale 0)
        if scheme == "minmax":
            assert torch.equal(y, x)


def test_absmax_with_two_or_more_bits_represents_zero_and_the_extremes_exactly():
    x = torch.tensor([-3.0, 0.0, 3.0, 1.0])
    for bits in (2, 4, 8):
        y = dequantize(*quantize(x, bits, "absmax"), bits, "absmax", 4, x.shape)
        assert y[:3].tolist() == [-3.0, 0.0, 3.0]


def test_one_bit_absmax_is_the_sign_times_the_absolute_maximum():
    x = torch.tensor([-2.0, 0.5, 4.0, -0.1])
    y = dequantize(*quantize(x, 1, "absmax"), 1, "absmax", 4, x.shape)
    assert y.tolist() == [-4.0, 4.0, 4.0, -4.0]


def test_stochastic_rounding_is_unbiased():
    x = torch.linspace(-1, 1, 257).repeat(1600)  # 257 distinct values, each seen 1600 times, distinct draws
    packed, scales, zeros = quantize(x, 2, "minmax", 257, stochastic=True, seed=3)
    y = dequantize(packed, scales, zeros, 2, "minmax", 257, x.shape).reshape(1600, 257)
    mean_err = (y.mean(0) - x[:257]).abs().max()
    step = float(scales[0])
    assert mean_err < 4.5 * step / 2 / 1600**0.5  # 4.5 sigma: a mean of 1600 draws of variance <= step^2 / 4
    nearest = dequantize(*quantize(x[:257], 2, "minmax"), 2, "minmax", 257, (257,))
    assert (nearest - x[:257]).abs().max() > 5 * mean_err  # while nearest rounding is biased here


def test_stochastic_rounding_depends_on_seed_and_index_only():
    x = torch.randn(64, 100, generator=torch.Generator().manual_seed(0))
    a = quantize(x, 4, "absmax", 100, stochastic=True, seed=7)[0]
    assert torch.equal(a, quantize(x, 4, "absmax", 100, stochastic=True, seed=7)[0])
    assert not torch.equal(a, quantize(x, 4, "absmax", 100, stochastic=True, seed=8)[0])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quantize(x, 4, "absmax", 100, stochastic=True, seed=7)[0]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(a, one)


def test_half_precision_inputs_quantize_their_float32_image():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float16, torch.bfloat16):
        got = quantize(x.to(dtype), 4, "minmax", 32)
        want = quantize(x.to(dtype).float(), 4, "minmax", 32)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_non_contiguous_and_empty_inputs():
    x = torch.randn(40, 6).t()
    got = quantize(x, 4, "absmax", 40)
    want = quantize(x.contiguous(), 4, "absmax", 40)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    packed, scales, zeros = quantize(torch.zeros(0, 5), 4, "minmax", 5)
    assert packed.shape == (0,) and scales.shape == (0,)
    assert dequantize(packed, scales, zeros, 4, "minmax", 5, (0, 5)).shape == (0, 5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_refused(bad):
    x = torch.ones(4, 8)
    x[2, 3] = bad
    with pytest.raises(RuntimeError, match=r"'x' must be finite: 1 of 4 group\(s\) hold NaN or \+-inf"):
        quantize(x, 8, "minmax", 8)


def test_a_range_that_overflows_float32_is_refused():
    x = torch.tensor([-3e38, 3e38])
    with pytest.raises(RuntimeError, match="'x' must be finite"):
        quantize(x, 8, "minmax")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = torch.randn(6, 10).to(device)
    for bits, scheme, group, stochastic in ((4, "minmax", 10, False), (1, "absmax", 60, True), (8, "absmax", 5, False)):
        torch.library.opcheck(torch.ops.fastdist.quantize.default, (x, bits, scheme, group, stochastic, 3))
        packed, scales, zeros = quantize(x, bits, scheme, group, stochastic, 3)
        torch.library.opcheck(torch.ops.fastdist.dequantize.default,
                              (packed, scales, zeros, bits, scheme, group, [6, 10]))


@pytest.mark.parametrize("device", DEVICES)
def test_ops_compile_with_fullgraph(device):
    def round_trip(x):
        packed, scales, zeros = quantize(x, 4, "minmax", 16)
        return dequantize(packed, scales, zeros, 4, "minmax", 16, x.shape)

    x = torch.randn(8, 16).to(device)
    assert torch.equal(torch.compile(round_trip, fullgraph=True)(x), round_trip(x))


@pytest.mark.cuda
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("bits", BITS)
def test_cuda_codes_and_values_are_bit_identical_to_cpu(bits, stochastic):
    x = torch.randn(33, 130, generator=torch.Generator().manual_seed(bits))
    for scheme in SCHEMES:
        cpu = quantize(x, bits, scheme, 130, stochastic, 5)
        gpu = quantize(x.cuda(), bits, scheme, 130, stochastic, 5)
        assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu))
        assert torch.equal(dequantize(*cpu, bits, scheme, 130, x.shape),
                           dequantize(*gpu, bits, scheme, 130, x.shape).cpu())


# ---- bad inputs ----

def _q(d):
    return quantize(torch.ones(4, 8, device=d), 4, "minmax", 8)


BAD_INPUTS = {
    "bits_3": (lambda d: quantize(torch.ones(8, device=d), 3, "minmax", 8), "'bits' must be 1, 2, 4 or 8, got 3"),
    "bits_16": (lambda d: quantize(torch.ones(8, device=d), 16, "minmax", 8), "'bits' must be 1, 2, 4 or 8, got 16"),
    "scheme": (lambda d: quantize(torch.ones(8, device=d), 4, "maxabs", 8),
               "'scheme' must be \"minmax\" or \"absmax\", got \"maxabs\""),
    "group_zero": (lambda d: quantize(torch.ones(8, device=d), 4, "minmax", 0), "'group_size' must be >= 1, got 0"),
    "group_not_dividing": (lambda d: quantize(torch.ones(8, device=d), 4, "minmax", 3),
                           "'group_size' must divide the number of values, got group_size = 3 for 8 values"),
    "int_x": (lambda d: quantize(torch.ones(8, dtype=torch.int32, device=d), 4, "minmax", 8),
              "'x' must have dtype torch.float32, torch.float16 or torch.bfloat16, got torch.int32"),
    "negative_seed": (lambda d: quantize(torch.ones(8, device=d), 4, "minmax", 8, True, -1),
                      r"'seed' must be in \[0, 2\^63\), got -1"),
    "dequant_short_packed": (lambda d: dequantize(_q(d)[0][:3], *_q(d)[1:], 4, "minmax", 8, [4, 8]),
                             r"'packed' must have shape \[16\] \(ceil\(n \* bits / 8\) for n = 32, bits = 4\), "
                             r"got shape \[3\]"),
    "dequant_wrong_scales": (lambda d: dequantize(_q(d)[0], _q(d)[1][:2], _q(d)[2], 4, "minmax", 8, [4, 8]),
                             r"'scales' must have shape \[4\] \(one per group\), got shape \[2\]"),
    "dequant_half_scales": (lambda d: dequantize(_q(d)[0], _q(d)[1].half(), _q(d)[2], 4, "minmax", 8, [4, 8]),
                            "'scales' must have dtype torch.float32, got torch.float16"),
    "dequant_bits": (lambda d: dequantize(*_q(d), 5, "minmax", 8, [4, 8]), "'bits' must be 1, 2, 4 or 8, got 5"),
    "dequant_negative_shape": (lambda d: dequantize(*_q(d), 4, "minmax", 8, [-4, 8]),
                               r"'shape' must not be negative"),
    "dequant_shape_past_int64": (lambda d: dequantize(*_q(d), 8, "minmax", 1, [2**62, 4]),
                                 r"the output would have shape \[4611686018427387904, 4\] of torch.float32: its "
                                 r"strides or its size in bytes pass int64"),
    "dequant_bit_offsets_past_int64": (lambda d: dequantize(*_q(d), 8, "minmax", 1, [2**60]),
                                       r"the number of values \* 'bits' = 1152921504606846976 \* 8 does not fit in "
                                       r"int64"),
    "quantize_bit_offsets_past_int64": (lambda d: quantize(huge([2**60], device=d), 8, "minmax", 1),
                                        r"the number of values \* 'bits' = 1152921504606846976 \* 8 does not fit in "
                                        r"int64"),
    "quantize_float32_copy_past_int64": (lambda d: quantize(huge([2**61], torch.bfloat16, d), 8, "minmax", 1),
                                         r"the float32 copy of 'x' would have shape \[2305843009213693952\] of "
                                         r"torch.float32"),
}


test_bad_inputs_raise_a_clear_error, test_fake_kernels_reject_bad_inputs_like_the_real_ones = \
    bad_input_tests(BAD_INPUTS)
