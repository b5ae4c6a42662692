"""Property-based fuzzing of every op: random shapes (zeros among them, and sizes whose products pass int64), views
that are not contiguous, every dtype, indices out of range, NaN of any sign and payload, infinities. Every call either
agrees with an oracle (each family's own, from its test module, or torch) or raises a clear error: a RuntimeError
whose message starts with "fastdist:" and that the fake kernel, given the same arguments, raises in the same words,
unless the data decide it (such checks run on real tensors only). An output of a size int64 can count but memory
cannot hold (a terabyte) may instead fail in torch's allocator, which says how many bytes it was asked for. A crash
or a hang fails the run.

Bounded for CI: a fixed number of examples per test, derandomized so that a failure repeats. CPU and fake tensors;
the CUDA kernels have their agreement tests in each family's file.
"""
import math

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from torch._subclasses.fake_tensor import FakeTensorMode

from fastdist import ops
from fastdist.comm import sketch_allreduce
from op_testing import huge
from test_epilogue import tolerance, torch_act
from test_moe import oracle_layout, oracle_permute, oracle_unpermute
from test_sketch import assert_same, median_over_rows, oracle_decode, oracle_sketch, python_hash
from test_topk import oracle_topk

fuzz = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64]
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# Sizes that pass int64 once multiplied by a few more (or by the bytes of an element); alone, terabytes, which torch's
# allocator refuses at once. (A size that memory could almost hold would be allocated and filled: not drawn.)
PAST_INT64 = [2**44, 2**60 - 1, 2**61, 2**62, 2**63 - 1]
OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"
# The checks that read the data: the fake kernels cannot make them.
DATA_DEPENDENT = ("entries must be in", "at most once", "must be finite", "must hold no NaN", "'indices' must be",
                  "must have exactly k")


def small(upper=9):
    return st.integers(0, upper)


def size_or_huge(upper=9):
    """A size, now and then one whose product with others passes int64."""
    return st.one_of(small(upper), small(upper), small(upper), st.sampled_from(PAST_INT64))


@st.composite
def shapes(draw, min_dims=0, max_dims=3, upper=9):
    """A small shape, or one with a zero and a size past int64 that torch can still represent (numel 0)."""
    if draw(st.integers(0, 4)) == 0 and max_dims >= 2:
        dims = draw(st.integers(max(min_dims, 2), max_dims))
        zero_at = draw(st.integers(0, 1))  # at most one size before the zero: torch counts elements left to right
        shape = [0 if i == zero_at else draw(size_or_huge()) for i in range(dims)]
        shape[1 - zero_at] = draw(st.sampled_from(PAST_INT64))
        return shape
    return draw(st.lists(small(upper), min_size=min_dims, max_size=max_dims))


def special_floats(count, generator):
    """float32 NaNs (either sign, any payload, quiet or signalling), infinities, signed zeros, subnormals, extremes."""
    fixed = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, 1e-40, -3e-42, 3.4e38, -3.4e38])
    nan_bits = torch.randint(0x7F800001, 0x80000000, (count,), generator=generator)
    nan_bits = nan_bits - 2**32 * torch.randint(0, 2, (count,), generator=generator)  # the sign bit, as int32
    nans = nan_bits.to(torch.int32).view(torch.float32)
    return torch.where(torch.rand(count, generator=generator) < 0.5, nans,
                       fixed[torch.randint(0, len(fixed), (count,), generator=generator)])


@st.composite
def tensors(draw, shape, dtype, specials=True, int_range=(-3, 4)):
    """A tensor of `shape` and `dtype`: Gaussian values at a drawn scale, with a drawn fraction of special values, or
    small integers; sometimes a non-contiguous view of the same values. A huge shape is a view of (next to) nothing
    (op_testing.huge): as given when it holds a zero; else one element seen 2**44 times or more, whose copy no memory
    holds (torch's allocator refuses it at once), when int64 can count its bytes, and otherwise the same shape with
    its first size 0."""
    if shape and max(shape) > 2**20:
        if 0 not in shape and math.prod(shape) * dtype.itemsize > 2**62:
            shape = [0, *shape[1:]]
        return huge(shape, dtype)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    numel = math.prod(shape)
    if dtype.is_floating_point:
        x = torch.randn(numel, generator=g) * 10.0 ** draw(st.integers(-3, 4))
        fraction = draw(st.sampled_from([0.0, 0.1, 0.6, 0.9])) if specials else 0.0
        x = torch.where(torch.rand(numel, generator=g) < fraction, special_floats(numel, g), x)
    elif dtype == torch.bool:
        x = torch.rand(numel, generator=g) < 0.5
    else:
        lo, hi = (0, 8) if dtype == torch.uint8 else int_range
        x = torch.randint(lo, hi, (numel,), generator=g)
    x = x.to(dtype).reshape(shape)
    if x.dim() >= 1 and numel > 0 and draw(st.booleans()):
        wide = torch.zeros(*shape[:-1], 2 * shape[-1], dtype=dtype)
        wide[..., ::2] = x
        x = wide[..., ::2]
    return x


def checked(op, *args):
    """op(*args), or None after a clear error (see the module docstring); the fake kernel must agree either way."""
    def outcome(call_args):
        try:
            return op(*call_args), None
        except RuntimeError as error:
            return None, str(error).split("\n")[0]

    result, error = outcome(args)
    mode = FakeTensorMode()
    fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        fake_result, fake_error = outcome(fake_args)
    if error is not None and OUT_OF_MEMORY in error:
        assert fake_error is None, fake_error
        return None
    if error is not None:
        assert error.startswith("fastdist: "), error
        if any(phrase in error for phrase in DATA_DEPENDENT):
            assert fake_error in (None, error), (error, fake_error)
        else:
            assert fake_error == error, (error, fake_error)
        return None
    assert fake_error is None, fake_error
    for real, fake in zip(result if isinstance(result, tuple) else (result,),
                          fake_result if isinstance(fake_result, tuple) else (fake_result,)):
        assert real.shape == fake.shape and real.dtype == fake.dtype, (real.shape, fake.shape)
    return result


def packed_bits_of(mask):
    """numpy.packbits along the last dimension, little-endian within a byte (pack_bits' order)."""
    if mask.numel() == 0:  # numpy holds no array of 2**44 rows, even empty
        return torch.zeros(*mask.shape[:-1], ops.bitpack.packed_bytes(mask.shape[-1]), dtype=torch.uint8)
    return torch.from_numpy(np.packbits(mask.numpy().astype(bool), axis=-1, bitorder="little"))


# ---- bitpack ----

@fuzz
@given(st.data())
def test_bit_packing_of_any_mask_agrees_with_numpy_or_raises(data):
    draw = data.draw
    mask = draw(tensors(draw(shapes()), draw(st.sampled_from([torch.bool] * 4 + DTYPES))))
    packed = checked(ops.pack_bits, mask)
    if packed is not None:
        assert torch.equal(packed, packed_bits_of(mask))

    n = draw(size_or_huge(40))
    lead = draw(shapes(max_dims=2))
    width = ops.bitpack.packed_bytes(n) if n < 2**20 and draw(st.integers(0, 3)) else draw(small(6))
    dtype = draw(st.sampled_from([torch.uint8] * 4 + DTYPES))
    packed_in = draw(tensors([*lead, width], dtype, int_range=(0, 256))) if width < 2**20 else huge([*lead, width])
    unpacked = checked(ops.unpack_bits, packed_in, n)
    if unpacked is not None and unpacked.numel():
        bits = np.unpackbits(packed_in.numpy(), axis=-1, count=n, bitorder="little").astype(bool)
        assert torch.equal(unpacked, torch.from_numpy(bits).reshape(unpacked.shape))

    bitmaps = draw(tensors(draw(shapes(min_dims=1, max_dims=3)), dtype, int_range=(0, 256)))
    union = checked(ops.bitwise_or_reduce, bitmaps)
    if union is not None and bitmaps.numel():
        assert torch.equal(union, torch.from_numpy(np.bitwise_or.reduce(bitmaps.numpy(), axis=0)))


# ---- sketch ----

def oracle_units_sketch(values, units, rows, cols, seed):
    """count_sketch_units by its definition: value col of row t is flat index units[t] * m + col (wrapping like
    unsigned 64-bit), added in the order listed, zeros skipped, in float32."""
    k, m = values.shape[0], math.prod(values.shape[1:])
    if values.numel() == 0:
        return torch.zeros(rows, cols)
    flat = values.reshape(-1).float()
    idx = (units.reshape(-1, 1) * m + torch.arange(m)).reshape(-1)
    keep = (flat != 0).nonzero().flatten()
    bucket, sign = ops.sketch_hash(idx[keep], rows, cols, seed, max(m, 1))
    table = np.zeros((rows, cols), dtype=np.float32)
    for j in range(rows):
        np.add.at(table[j], bucket[j].numpy(), sign[j].numpy().astype(np.float32) * flat[keep].numpy())
    return torch.from_numpy(table)


def oracle_decode_units(table, units, m, seed):
    rows, cols = table.shape
    if units.numel() * m == 0:
        return torch.zeros(units.shape[0], m)
    idx = (units.reshape(-1, 1) * m + torch.arange(m)).reshape(-1)
    bucket, sign = ops.sketch_hash(idx, rows, cols, seed, max(m, 1))
    est = torch.stack([sign[j].float() * table[j, bucket[j]] for j in range(rows)])
    return median_over_rows(est).reshape(units.shape[0], m)


@fuzz
@given(st.data())
def test_sketch_ops_on_any_input_agree_with_their_definitions_or_raise(data):
    draw = data.draw
    granularity = draw(st.sampled_from(["row", "row", "element", "col"]))
    x = draw(tensors(draw(shapes()), draw(st.sampled_from(FLOATS * 2 + DTYPES))))
    rows, cols = draw(st.integers(0, 16)), draw(st.one_of(st.integers(0, 40), st.sampled_from([-3, 2**31])))
    seed = draw(st.one_of(st.integers(0, 2**63 - 1), st.sampled_from([-1, 2**63])))
    support = checked(ops.nonzero_bitmap, x, granularity)
    if support is not None:
        units = x.flatten(1) if granularity == "row" and x.dim() > 1 else x.reshape(-1, 1)
        assert torch.equal(support, packed_bits_of((units.float() != 0).any(1)))
    if draw(st.booleans()):  # a support of some length, not necessarily the right one
        support = draw(tensors([draw(size_or_huge(6))], draw(st.sampled_from([torch.uint8] * 3 + DTYPES)),
                               int_range=(0, 256)))
    table = checked(ops.count_sketch, x, rows, cols, seed, support, granularity)
    if table is not None:
        assert_same(table, oracle_sketch(x, rows, cols, seed, support, granularity))

    n, m = draw(size_or_huge(20)), draw(size_or_huge(5))
    if table is None:
        table = draw(tensors([draw(small(16)), draw(small(40))], draw(st.sampled_from([torch.float32] * 3 + DTYPES))))
    width = ops.bitpack.packed_bytes(n) if n < 2**20 and draw(st.integers(0, 3)) else draw(small(4))
    unit_support = draw(tensors([width], torch.uint8, int_range=(0, 256)))
    decoded = checked(ops.count_sketch_decode, table, unit_support, n, m, seed)
    if decoded is not None:
        assert_same(decoded, oracle_decode(table, unit_support, n, m, seed))

    values = draw(tensors(draw(shapes(min_dims=0)), draw(st.sampled_from(FLOATS * 2 + DTYPES))))
    listed = draw(tensors([values.shape[0] if values.dim() and draw(st.integers(0, 3)) else draw(small(5))],
                          draw(st.sampled_from([torch.int64] * 3 + DTYPES)), int_range=(-2**62, 2**62)))
    units_table = checked(ops.count_sketch_units, values, listed, rows, cols, seed)
    if units_table is not None:
        assert_same(units_table, oracle_units_sketch(values, listed, rows, cols, seed))
    estimates = checked(ops.count_sketch_decode_units, table, listed, m, seed)
    if estimates is not None:
        assert_same(estimates, oracle_decode_units(table, listed, m, seed))

    m_hash = draw(st.integers(-1, 4))
    hashed = checked(ops.sketch_hash, listed, rows, cols, seed, m_hash)
    if hashed is not None:
        want = python_hash([i % 2**64 for i in listed.tolist()], rows, cols, seed, m_hash)  # indices as unsigned
        assert (hashed[0].tolist(), hashed[1].tolist()) == want


# ---- TopK ----

@fuzz
@given(st.data())
def test_topk_ops_on_any_input_agree_with_the_sort_oracle_or_raise(data):
    draw = data.draw
    x = draw(tensors(draw(shapes(min_dims=1, upper=40)), draw(st.sampled_from([torch.float32] * 6 + FLOATS + DTYPES))))
    k = draw(st.one_of(st.integers(1, 3), st.integers(-1, 45)))  # few kept: NaNs compete for the places
    kept = checked(ops.topk_compress, x, k)
    if kept is not None:
        values, indices = kept
        want_values, want_indices = oracle_topk(x, k)
        assert torch.equal(indices, want_indices)
        assert torch.equal(values.view(torch.int16 if values.element_size() == 2 else torch.int32),
                           want_values.view(torch.int16 if values.element_size() == 2 else torch.int32))

    values_dtype = draw(st.sampled_from(FLOATS[:3] * 2 + DTYPES))
    values = draw(tensors(draw(shapes(min_dims=2, max_dims=2, upper=6)), values_dtype))
    d = draw(st.one_of(st.just(values.shape[1]), st.integers(-1, 45), st.just(2**31)))  # int32 indices: d < 2**31
    indices = draw(tensors(list(values.shape), draw(st.sampled_from([torch.int32] * 3 + DTYPES)), int_range=(-2, 50)))
    if draw(st.booleans()) and 0 < indices.numel() < 2**20:  # ascending, as compress gives them (maybe past d)
        steps = indices.long().abs() + 1
        indices = (steps.cumsum(1) - steps[:, :1]).to(indices.dtype)
    dense = checked(ops.topk_decompress, values, indices, d)
    if dense is not None:
        want = torch.zeros(values.shape[0], d, dtype=values.dtype)
        for r in range(values.shape[0] if values.numel() else 0):
            for j in range(values.shape[1]):
                want[r, indices[r, j]] = values[r, j]  # a repeated index keeps its last value
        assert_same(dense, want)
    bitmap = checked(ops.topk_indices_to_bitmap, indices, d)
    if bitmap is not None:
        mask = torch.zeros(indices.shape[0], d, dtype=torch.bool)
        mask.scatter_(1, indices.long(), True)
        assert torch.equal(bitmap, packed_bits_of(mask))
    else:
        bitmap = draw(tensors([draw(small(4)), draw(small(7))], draw(st.sampled_from([torch.uint8] * 3 + DTYPES)),
                              int_range=(0, 256)))
    positions = checked(ops.topk_bitmap_to_indices, bitmap, d, draw(st.integers(-1, 12)))
    if positions is not None and positions.numel():
        bits = np.unpackbits(bitmap.numpy(), axis=-1, count=d, bitorder="little").astype(bool)
        assert positions.tolist() == [np.flatnonzero(row).tolist() for row in bits]


# ---- quantize ----

@fuzz
@given(st.data())
def test_quantize_of_any_input_round_trips_within_its_bound_or_raises(data):
    draw = data.draw
    x = draw(tensors(draw(shapes()), draw(st.sampled_from(FLOATS[:3] * 2 + DTYPES))))
    bits = draw(st.sampled_from([1, 2, 4, 8, 1, 2, 4, 8, 0, 3, 16]))
    scheme = draw(st.sampled_from(["minmax", "absmax", "minmax", "absmax", "max"]))
    numel = x.numel()
    divisors = [g for g in range(1, min(numel, 64) + 1) if numel % g == 0] or [1]
    group = draw(st.one_of(st.sampled_from(divisors), st.integers(-1, 70), st.sampled_from(PAST_INT64)))
    stochastic, seed = draw(st.booleans()), draw(st.integers(0, 2**63 - 1))
    quantized = checked(ops.quantize, x, bits, scheme, group, stochastic, seed)
    if quantized is not None and numel:
        packed, scales, zeros = quantized
        back = checked(ops.dequantize, packed, scales, zeros, bits, scheme, group, x.shape)
        scale = scales.repeat_interleave(group)[:numel].reshape(x.shape)
        bound = scale * (1.0 if stochastic else 0.5) * (1 + 1e-5) + 1e-30
        assert ((back - x.float()).abs() <= bound).all()
    shape = draw(st.lists(st.one_of(small(6), st.just(-1), st.sampled_from(PAST_INT64)), max_size=3))
    nbytes, groups = draw(small(8)), draw(small(8))
    codes = draw(tensors([nbytes], draw(st.sampled_from([torch.uint8] * 3 + DTYPES)), int_range=(0, 256)))
    scales = draw(tensors([groups], draw(st.sampled_from([torch.float32] * 3 + DTYPES)), specials=False))
    back = checked(ops.dequantize, codes, scales, scales.clone(), bits, scheme, draw(st.integers(0, 9)), shape)
    if back is not None:
        assert back.shape == tuple(shape) and back.dtype == torch.float32


# ---- epilogue ----

def assert_epilogue_close(got, want, dtype, scale):
    """got (in dtype) against the float64 `want`: NaN and infinities alike, else within the dtype's tolerance relative
    to `scale`, the size of what went in (the float32 GeLU's error is relative to u, times grad in the backward, and a
    sum with the residual can cancel to far below its terms, not their error)."""
    atol, rtol = tolerance(dtype)
    want = want.to(dtype).double()
    got = got.double()
    assert torch.equal(got.isnan(), want.isnan())
    finite = want.isfinite() & got.isfinite()
    assert torch.equal(got[~finite & ~got.isnan()], want[~finite & ~want.isnan()])
    assert ((got - want).abs()[finite] <= (atol + rtol * (scale.double().abs() + want.abs()))[finite]).all()


@fuzz
@given(st.data())
def test_bias_epilogue_of_any_input_saturates_like_torch_in_float64_or_raises(data):
    draw = data.draw
    shape = draw(shapes())
    dtype = draw(st.sampled_from(FLOATS * 3 + DTYPES))
    x = draw(tensors(shape, dtype))
    cols = shape[-1] if shape else 0
    bias = draw(st.one_of(st.none(), tensors([cols if draw(st.integers(0, 4)) else draw(small(5))],
                                             draw(st.sampled_from([dtype] * 4 + DTYPES)))))
    residual = draw(st.one_of(st.none(), tensors(shape if draw(st.integers(0, 4)) else draw(shapes()),
                                                 draw(st.sampled_from([dtype] * 4 + DTYPES)))))
    activation = draw(st.sampled_from(["none", "gelu_tanh", "gelu_erf", "relu"]))
    out = checked(ops.bias_epilogue, x, bias, residual, activation)
    if out is not None:
        u = x.double() + (bias.double() if bias is not None else 0)
        act = torch_act(u, activation)
        res = residual.double() if residual is not None else torch.zeros_like(act)
        assert_epilogue_close(out, act + res, dtype, u.nan_to_num(0, 0, 0).abs() + res.nan_to_num(0, 0, 0).abs())
    grad = draw(tensors(shape, dtype))
    grad_x = checked(ops.bias_epilogue_backward, grad, x, bias, activation)
    if grad_x is not None:
        u = (x.double() + (bias.double() if bias is not None else 0)).requires_grad_()
        torch_act(u, activation).backward(grad.double())
        assert_epilogue_close(grad_x, u.grad, dtype, grad.double().nan_to_num(0, 0, 0))


# ---- MoE ----

@fuzz
@given(st.data())
def test_moe_ops_on_any_input_agree_with_their_definitions_or_raise(data):
    draw = data.draw
    tokens, experts = draw(small(12)), draw(st.integers(0, 6))
    logits = draw(tensors([tokens, experts], draw(st.sampled_from([torch.float32, torch.float64] * 3 + DTYPES))))
    k = draw(st.integers(0, 7))
    routed = checked(ops.moe_route, logits, k)
    if routed is not None:
        probs, lse, idx, weight = routed
        torch.testing.assert_close(probs.double(), logits.double().softmax(-1), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(lse.double(), logits.double().logsumexp(-1), rtol=1e-6, atol=1e-6)
        assert torch.equal(idx, probs.sort(dim=-1, descending=True, stable=True).indices[:, :k])
        assert torch.equal(weight, probs.gather(1, idx))

    num_experts = draw(st.one_of(st.integers(1, 6), st.integers(0, 6), st.sampled_from(PAST_INT64)))
    ids_dtype = draw(st.sampled_from([torch.int64] * 10 + DTYPES))
    ids = draw(tensors(draw(shapes(min_dims=2, max_dims=2, upper=10)), ids_dtype, int_range=(-1, 7)))
    ranks, capacity = draw(st.one_of(st.just(1), st.integers(0, 3))), draw(st.integers(-2, 6))
    layout = checked(ops.moe_layout, ids, num_experts, ranks, capacity)
    if layout is not None and ids.numel() == 0:  # no assignments, however many tokens an empty tensor claims
        assert all(not t.any() for t in layout[:3]) and all(t.numel() == 0 for t in layout[3:])
    elif layout is not None:
        for name, got, want in zip(("counts", "offsets", "rank_counts", "permutation", "row_of_slot", "position",
                                    "keep"), layout, oracle_layout(ids, num_experts, ranks, capacity)):
            assert torch.equal(got, want), name

    dtype = draw(st.sampled_from(FLOATS * 2 + DTYPES))
    x = draw(tensors([tokens, draw(size_or_huge(4))], dtype))
    num_rows = draw(st.one_of(st.integers(1, 10), st.integers(-1, 10), st.sampled_from(PAST_INT64)))
    named = (-1, num_rows) if 0 < num_rows <= 10 and draw(st.integers(0, 3)) else (-2, 11)  # mostly rows in range
    slots = draw(tensors([tokens if draw(st.integers(0, 4)) else draw(small(4)), draw(small(3))],
                         draw(st.sampled_from([torch.int64] * 8 + DTYPES)), int_range=named))
    weight = draw(st.one_of(st.none(), tensors(list(slots.shape), draw(st.sampled_from([dtype] * 3 + DTYPES)))))
    permuted = checked(ops.moe_permute, x, slots, num_rows, weight)
    if permuted is not None:
        kept = slots[slots >= 0]
        assert kept.unique().numel() == kept.numel()  # a row named twice was refused
        assert_same(permuted, oracle_permute(x, slots, num_rows, weight))
    y = draw(tensors([draw(small(10)), draw(size_or_huge(4))], dtype))
    combined = checked(ops.moe_unpermute, y, slots, weight)
    if combined is not None:
        assert_same(combined, oracle_unpermute(y, slots, weight))


# ---- sketch_allreduce's sparse rows (checked before any communication) ----

@fuzz
@given(st.data())
def test_sketch_allreduce_rejects_sparse_rows_outside_the_tensor_before_communicating(data):
    n = data.draw(st.integers(1, 20))
    rows = data.draw(st.lists(st.integers(-2 * n, 2 * n), min_size=1, max_size=6))
    assume(min(rows) < 0 or max(rows) >= n)
    tensor = torch.sparse_coo_tensor([rows], torch.ones(len(rows), 3), (n, 3), check_invariants=False)
    with pytest.raises(ValueError, match=rf"row indices must be in \[0, {n}\), got values in \[{min(rows)}, "
                                         rf"{max(rows)}\]"):
        sketch_allreduce(tensor)
