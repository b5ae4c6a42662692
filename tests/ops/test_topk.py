"""fastdist.ops.topk_compress / topk_decompress / topk bitmaps: the spec (k largest magnitudes, ties to the lower
index, ascending output order), checked against a stable-sort oracle, torch.topk, and round trips."""
import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from fastdist.ops import (
    pack_bits,
    topk_bitmap_to_indices,
    topk_compress,
    topk_decompress,
    topk_indices_to_bitmap,
)
from fastdist.ops.topk import topk_k
from hypothesis import given, settings
from op_testing import DEVICES, bad_input_tests, huge


def oracle_topk(x, k):
    """The definition, independently: sort positions by (-magnitude key, index), keep k, sort by index.

    The key is the float32 bit pattern with the sign cleared, compared as integers, every NaN with the same key just
    above inf's (NaN above inf above finite; NaNs tie)."""
    x32 = x.detach().cpu().float()
    keys = (x32.view(torch.int32) & 0x7FFFFFFF).to(torch.int64).clamp(max=0x7F800001)
    order = np.lexsort((np.broadcast_to(np.arange(x32.shape[1]), x32.shape), -keys.numpy()), axis=1)
    kept = np.sort(order[:, :k], axis=1)
    idx = torch.from_numpy(kept.astype(np.int32))
    return x.detach().cpu().gather(1, idx.long()), idx


def assert_topk_matches(x, k, device="cpu"):
    values, indices = topk_compress(x.to(device), k)
    want_v, want_i = oracle_topk(x, k)
    assert indices.dtype == torch.int32 and values.dtype == x.dtype
    assert torch.equal(indices.cpu(), want_i)
    assert torch.equal(values.cpu(), want_v)


def gaussian(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape, k", [((1, 1), 1), ((3, 7), 1), ((3, 7), 7), ((5, 100), 10), ((4, 4099), 410),
                                      ((2, 65536), 6554), ((7, 33), 32), ((0, 5), 3)])
def test_topk_compress_matches_the_sort_oracle(device, shape, k):
    assert_topk_matches(gaussian(shape, seed=shape[1]), k, device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_topk_of_half_precision_inputs_selects_on_their_exact_values(dtype):
    assert_topk_matches(gaussian((6, 301), seed=3, dtype=dtype), 40)


def test_topk_keeps_the_same_set_as_torch_topk_when_magnitudes_are_distinct():
    x = gaussian((16, 5000), seed=1)
    values, indices = topk_compress(x, 500)
    _, ref = torch.topk(x.abs(), 500, dim=1)
    assert torch.equal(indices.long(), ref.sort(dim=1).values)
    assert torch.equal(values, x.gather(1, indices.long()))


def test_ties_go_to_the_lower_index_including_signed_zeros():
    x = torch.tensor([[1.0, -2.0, 2.0, -1.0, 2.0, 0.5],
                      [0.0, -0.0, 0.0, -0.0, 0.0, 0.0],
                      [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]])
    values, indices = topk_compress(x, 3)
    assert indices.tolist() == [[1, 2, 4], [0, 1, 2], [0, 1, 2]]
    assert values[0].tolist() == [-2.0, 2.0, 2.0]
    values, indices = topk_compress(x, 2)
    assert indices.tolist() == [[1, 2], [0, 1], [0, 1]]


def test_values_that_differ_only_in_low_mantissa_bits_are_ordered_exactly():
    # every radix pass matters: the keys differ in bits 0..9 only, inside one bucket of both upper passes
    base = torch.tensor(1.5).view(torch.int32).item()
    keys = torch.tensor([base + 7, base + 3, base + 1023, base, base + 512, base + 3], dtype=torch.int32)
    x = keys.view(torch.float32).reshape(1, -1)
    _, indices = topk_compress(x, 3)
    assert indices.tolist() == [[0, 2, 4]]
    _, indices = topk_compress(x, 4)
    assert indices.tolist() == [[0, 1, 2, 4]]  # 1 and 5 tie: the lower index wins


def test_nan_ranks_above_inf_which_ranks_above_finite_values():
    x = torch.tensor([[1.0, float("-inf"), 5.0, float("nan"), -7.0, float("inf")]])
    values, indices = topk_compress(x, 1)
    assert indices.tolist() == [[3]] and values[0, 0].isnan()
    values, indices = topk_compress(x, 2)  # -inf and +inf tie on magnitude: the lower index wins
    assert indices.tolist() == [[1, 3]] and values[0, 0] == float("-inf")
    _, indices = topk_compress(x, 3)
    assert indices.tolist() == [[1, 3, 5]]
    _, indices = topk_compress(x, 4)
    assert indices.tolist() == [[1, 3, 4, 5]]


def nans_with_payloads_increasing_by_index(d, positions, seed=0):
    """float32 [1, d] of Gaussian values with NaNs at `positions`: signalling and quiet, either sign, their magnitude
    bits increasing along the row, so that ordering NaNs by payload would keep the last ones first."""
    x = gaussian((1, d), seed=seed)
    bits = x.view(torch.int32)
    for n, p in enumerate(positions):
        magnitude = 0x7F800001 + n * ((0x7FFFFFFF - 0x7F800001) // (len(positions) - 1))
        bits[0, p] = magnitude - (2**31 if n % 2 else 0)  # odd ones with the sign bit set
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [6, 40, 9000, 70_000])
def test_tied_nans_are_kept_by_index_whatever_their_payload_and_sign(device, d):
    # rows of 9000+ values take the sampled path of the CPU kernel, 40 the eight-lane one, 6 the scalar one
    positions = sorted(torch.randperm(d, generator=torch.Generator().manual_seed(d))[:5].tolist())
    x = nans_with_payloads_increasing_by_index(d, positions)
    for k in (1, 3, 5):
        values, indices = topk_compress(x.to(device), k)
        assert indices.tolist() == [positions[:k]]
        assert torch.equal(values.cpu().view(torch.int32), x[:, positions[:k]].view(torch.int32))  # payloads kept
    _, indices = topk_compress(x.to(device), 6)  # past the NaNs: the largest finite magnitude
    assert indices[0].tolist() == sorted(positions + [int(x.nan_to_num(0).abs().argmax())])


def test_tied_nans_in_a_long_row_split_between_threads_are_kept_by_index():
    positions = list(range(1000, 3 << 20, 1 << 18))
    x = nans_with_payloads_increasing_by_index(3 << 20, positions, seed=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _, indices = topk_compress(x, 4)
    finally:
        torch.set_num_threads(before)
    assert indices.tolist() == [positions[:4]]


def test_non_contiguous_input_gives_the_result_of_its_contiguous_copy():
    x = gaussian((300, 40), seed=5).t()
    assert not x.is_contiguous()
    a = topk_compress(x, 17)
    b = topk_compress(x.contiguous(), 17)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_per_tensor_mode_is_the_row_op_on_the_flattened_tensor():
    x = gaussian((8, 64, 3), seed=2)
    values, indices = topk_compress(x.reshape(1, -1), 100)
    want_v, want_i = oracle_topk(x.reshape(1, -1), 100)
    assert torch.equal(indices, want_i) and torch.equal(values, want_v)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), d=st.integers(1, 300), ratio=st.floats(0.001, 1.0), seed=st.integers(0, 2**31),
       levels=st.sampled_from([0, 3, 50]))
def test_decompress_of_compress_keeps_exactly_the_k_largest_magnitudes(rows, d, ratio, seed, levels):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=g)
    if levels:  # many exact ties
        x = torch.randint(-levels, levels + 1, (rows, d), generator=g).float()
    k = topk_k(ratio, d)
    values, indices = topk_compress(x, k)
    dense = topk_decompress(values, indices, d)
    kept = torch.zeros(rows, d, dtype=torch.bool).scatter_(1, indices.long(), True)
    assert torch.equal(dense, torch.where(kept, x, torch.zeros(())))
    assert (kept.sum(1) == k).all()
    # every kept magnitude >= every dropped one; among equal magnitudes the kept ones come first
    for r in range(rows):
        a = x[r].abs()
        if k < d:
            assert a[kept[r]].min() >= a[~kept[r]].max()
            t = a[kept[r]].min()
            tied = ((a == t) & ~kept[r]).nonzero()
            if tied.numel():
                assert ((a == t) & kept[r]).nonzero().max() < tied.min()
    assert_topk_matches(x, k)


def test_topk_k_is_the_ceiling_of_ratio_times_d():
    assert topk_k(0.1, 30) == 3 and topk_k(0.1, 31) == 4 and topk_k(1e-6, 10) == 1 and topk_k(1.0, 7) == 7
    with pytest.raises(ValueError, match="'ratio' must be in"):
        topk_k(0.0, 10)


@pytest.mark.parametrize("device", DEVICES)
def test_decompress_puts_values_at_their_indices_and_zeros_elsewhere(device):
    values = torch.tensor([[1.0, 2.0], [3.0, -4.0]], device=device)
    indices = torch.tensor([[4, 0], [1, 2]], dtype=torch.int32, device=device)
    out = topk_decompress(values, indices, 5)
    assert out.tolist() == [[2.0, 0, 0, 0, 1.0], [0, 3.0, -4.0, 0, 0]]


def test_decompress_rejects_out_of_range_indices_on_cpu():
    with pytest.raises(RuntimeError, match=r"'indices' must be in \[0, d\) with d = 4, got 2 out of range"):
        topk_decompress(torch.ones(1, 3), torch.tensor([[0, 4, -1]], dtype=torch.int32), 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d, k", [(1, 1), (9, 3), (64, 64), (100, 37), (1000, 1), (4099, 2000)])
def test_bitmap_round_trip_and_pack_bits_order(device, d, k):
    x = gaussian((3, d), seed=d)
    _, indices = topk_compress(x.to(device), k)
    bitmap = topk_indices_to_bitmap(indices, d)
    mask = torch.zeros(3, d, dtype=torch.bool).scatter_(1, indices.long().cpu(), True)
    assert torch.equal(bitmap.cpu(), pack_bits(mask))
    assert torch.equal(topk_bitmap_to_indices(bitmap, d, k), indices)


def test_bitmap_decode_ignores_padding_bits_and_rejects_a_wrong_count():
    bitmap = torch.tensor([[0b00000101, 0b11111110]], dtype=torch.uint8)  # d = 9: only bit 0 of byte 1 counts
    assert topk_bitmap_to_indices(bitmap, 9, 2).tolist() == [[0, 2]]
    with pytest.raises(RuntimeError, match="'bitmap' must have exactly k = 3 bits set among the first d = 9"):
        topk_bitmap_to_indices(bitmap, 9, 3)


def test_bitmap_encode_rejects_unsorted_or_repeated_indices():
    for bad in ([[2, 1]], [[1, 1]], [[0, 9]]):
        with pytest.raises(RuntimeError, match="'indices' must be strictly ascending within"):
            topk_indices_to_bitmap(torch.tensor(bad, dtype=torch.int32), 9)


def test_results_do_not_depend_on_the_cpu_thread_count():
    x = gaussian((64, 3000), seed=9)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = topk_compress(x, 300)
        torch.set_num_threads(max(2, before))
        many = topk_compress(x, 300)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


@pytest.mark.parametrize("ties", [False, True])
def test_a_long_single_row_split_between_threads_gives_the_one_thread_result(ties):
    # rows of >= 2^20 values are selected by chunks in parallel (per-tensor TopK); ties must still go to the lower
    # index across chunk borders
    g = torch.Generator().manual_seed(12)
    x = torch.randint(-50, 51, (1, 3 << 20), generator=g).float() if ties else torch.randn(1, 3 << 20, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        many = [topk_compress(x, k) for k in (1, 70_000, 1 << 20)]
        torch.set_num_threads(1)
        one = [topk_compress(x, k) for k in (1, 70_000, 1 << 20)]
    finally:
        torch.set_num_threads(before)
    for (va, ia), (vb, ib) in zip(many, one):
        assert torch.equal(ia, ib) and torch.equal(va, vb)
    want_v, want_i = oracle_topk(x, 70_000)
    assert torch.equal(many[1][1], want_i)


def test_gradients_flow_to_the_kept_positions_and_through_decompress():
    x = gaussian((3, 20), seed=4).double().float().requires_grad_()
    values, indices = topk_compress(x, 5)
    dense = topk_decompress(values, indices, 20)
    w = gaussian((3, 20), seed=8)
    (dense * w).sum().backward()
    kept = torch.zeros(3, 20, dtype=torch.bool).scatter_(1, indices.long(), True)
    assert torch.equal(x.grad, torch.where(kept, w, torch.zeros(())))


def test_gradcheck_of_decompress_and_compress():
    values = torch.randn(2, 4, dtype=torch.float32, requires_grad=True)
    indices = torch.tensor([[0, 2, 3, 5], [1, 2, 4, 6]], dtype=torch.int32)
    torch.autograd.gradcheck(lambda v: topk_decompress(v, indices, 7), (values,), eps=1e-2, atol=1e-3, rtol=1e-2)
    x = torch.randn(2, 9, requires_grad=True)
    torch.autograd.gradcheck(lambda t: topk_compress(t, 3)[0], (x,), eps=1e-3, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = gaussian((5, 37), seed=1).to(device)
    torch.library.opcheck(torch.ops.fastdist.topk_compress.default, (x, 6))
    torch.library.opcheck(torch.ops.fastdist.topk_compress.default, (gaussian((40, 5)).t().to(device), 2))
    v, i = topk_compress(x, 6)
    torch.library.opcheck(torch.ops.fastdist.topk_decompress.default, (v, i, 37))
    torch.library.opcheck(torch.ops.fastdist.topk_indices_to_bitmap.default, (i, 37))
    torch.library.opcheck(torch.ops.fastdist.topk_bitmap_to_indices.default, (topk_indices_to_bitmap(i, 37), 37, 6))


@pytest.mark.parametrize("device", DEVICES)
def test_ops_compile_with_fullgraph(device):
    def round_trip(x):
        v, i = topk_compress(x, 10)
        return topk_decompress(v, topk_bitmap_to_indices(topk_indices_to_bitmap(i, x.shape[1]), x.shape[1], 10),
                               x.shape[1])

    x = gaussian((4, 100), seed=3).to(device)
    assert torch.equal(torch.compile(round_trip, fullgraph=True)(x), round_trip(x))


@pytest.mark.cuda
@pytest.mark.parametrize("shape, k", [((3, 5000), 500), ((2, 70000), 7), ((1, 3000), 3000)])
def test_cuda_selection_is_bit_identical_to_cpu(shape, k):
    x = gaussian(shape, seed=11)
    x[0, :100] = 1.0  # ties across tiles
    cpu = topk_compress(x, k)
    gpu = topk_compress(x.cuda(), k)
    assert torch.equal(cpu[0], gpu[0].cpu()) and torch.equal(cpu[1], gpu[1].cpu())
    assert torch.equal(topk_decompress(*cpu, shape[1]), topk_decompress(*gpu, shape[1]).cpu())


# ---- bad inputs ----

BAD_INPUTS = {
    "k_zero": (lambda d: topk_compress(torch.ones(2, 5, device=d), 0),
               r"'k' must be in \[1, d\] with d = 5 \(the row length\), got 0"),
    "k_above_d": (lambda d: topk_compress(torch.ones(2, 5, device=d), 6),
                  r"'k' must be in \[1, d\] with d = 5 \(the row length\), got 6"),
    "k_of_empty_rows": (lambda d: topk_compress(torch.ones(2, 0, device=d), 1),
                        r"'k' must be in \[1, d\] with d = 0"),
    "x_1d": (lambda d: topk_compress(torch.ones(5, device=d), 1), r"'x' must have 2 dimension\(s\), got shape \[5\]"),
    "x_int": (lambda d: topk_compress(torch.ones(2, 5, dtype=torch.int32, device=d), 1),
              "'x' must have dtype torch.float32, torch.float16 or torch.bfloat16, got torch.int32"),
    "x_float64": (lambda d: topk_compress(torch.ones(2, 5, dtype=torch.float64, device=d), 1),
                  "'x' must have dtype torch.float32, torch.float16 or torch.bfloat16, got torch.float64"),
    "decompress_int64_indices": (lambda d: topk_decompress(torch.ones(1, 2, device=d),
                                                           torch.zeros(1, 2, dtype=torch.int64, device=d), 4),
                                 "'indices' must have dtype torch.int32, got torch.int64"),
    "decompress_shape_mismatch": (lambda d: topk_decompress(torch.ones(1, 2, device=d),
                                                            torch.zeros(1, 3, dtype=torch.int32, device=d), 4),
                                  r"'values' and 'indices' must have the same shape, got \[1, 2\] and \[1, 3\]"),
    "decompress_d_too_small": (lambda d: topk_decompress(torch.ones(1, 3, device=d),
                                                         torch.zeros(1, 3, dtype=torch.int32, device=d), 2),
                               r"'values' must have at most d = 2 columns, got shape \[1, 3\]"),
    "decompress_negative_d": (lambda d: topk_decompress(torch.ones(1, 0, device=d),
                                                        torch.zeros(1, 0, dtype=torch.int32, device=d), -1),
                              r"'d' must be in \[0, 2\^31 - 1\], got -1"),
    "bitmap_wrong_length": (lambda d: topk_bitmap_to_indices(torch.zeros(1, 3, dtype=torch.uint8, device=d), 9, 1),
                            r"'bitmap' must have last dimension 2 \(ceil\(d / 8\) for d = 9\), got shape \[1, 3\]"),
    "bitmap_k_above_d": (lambda d: topk_bitmap_to_indices(torch.zeros(1, 2, dtype=torch.uint8, device=d), 9, 10),
                         r"'k' must be in \[0, d\] with d = 9, got 10"),
    "to_bitmap_float_indices": (lambda d: topk_indices_to_bitmap(torch.zeros(1, 2, device=d), 9),
                                "'indices' must have dtype torch.int32, got torch.float32"),
    "decompress_output_past_int64": (lambda d: topk_decompress(torch.ones(2**40, 0, device=d),
                                                               torch.zeros(2**40, 0, dtype=torch.int32, device=d),
                                                               2**31 - 1),
                                     r"the output would have shape \[1099511627776, 2147483647\] of torch.float32: "
                                     r"its strides or its size in bytes pass int64"),
    "to_bitmap_output_past_int64": (lambda d: topk_indices_to_bitmap(torch.zeros(2**40, 0, dtype=torch.int32,
                                                                                 device=d), 2**31 - 1),
                                    r"the output would have shape \[1099511627776, 268435456\] of torch.uint8"),
    "from_bitmap_output_past_int64": (lambda d: topk_bitmap_to_indices(huge([2**61, 1], torch.uint8, d), 8, 8),
                                      r"the output would have shape \[2305843009213693952, 8\] of torch.int32"),
    "compress_float32_copy_past_int64": (lambda d: topk_compress(huge([2**61, 2], torch.bfloat16, d), 1),
                                         r"the float32 copy of 'x' would have shape \[2305843009213693952, 2\] of "
                                         r"torch.float32"),
}


test_bad_inputs_raise_a_clear_error, test_fake_kernels_reject_bad_inputs_like_the_real_ones = \
    bad_input_tests(BAD_INPUTS)
