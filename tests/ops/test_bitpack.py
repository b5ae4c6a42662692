"""fastdist.ops.pack_bits / unpack_bits / bitwise_or_reduce / bitmap_from_indices: the spec, checked against numpy and
torch oracles."""
import functools

import numpy as np
import pytest
import torch
from fastdist.ops import bitwise_or_reduce, pack_bits, unpack_bits
from fastdist.ops.bitpack import bitmap_from_indices
from op_testing import DEVICES, bad_input_tests, huge

SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 4097, 65_537, 1_000_003]


def random_mask(shape, seed=0, p=0.5):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) < p


def random_bytes(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)


def numpy_pack(mask):
    return torch.from_numpy(np.packbits(mask.cpu().numpy(), axis=-1, bitorder="little"))


def numpy_unpack(packed, n):
    return torch.from_numpy(np.unpackbits(packed.cpu().numpy(), axis=-1, count=n, bitorder="little").astype(bool))


def torch_or_reduce(packed):
    return functools.reduce(torch.bitwise_or, packed.cpu(), torch.zeros(packed.shape[1], dtype=torch.uint8))


def assert_same(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    assert torch.equal(got.cpu(), want.cpu())


# ---- agreement with the oracles ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [(), (3,)], ids=["1d", "3rows"])
@pytest.mark.parametrize("n", SIZES)
def test_pack_bits_matches_numpy_packbits_little_endian(device, rows, n):
    mask = random_mask((*rows, n), seed=n)
    assert_same(pack_bits(mask.to(device)), numpy_pack(mask))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [(), (3,)], ids=["1d", "3rows"])
@pytest.mark.parametrize("n", SIZES)
def test_unpack_bits_matches_numpy_unpackbits(device, rows, n):
    packed = random_bytes((*rows, (n + 7) // 8), seed=n)  # padding bits set at random
    assert_same(unpack_bits(packed.to(device), n), numpy_unpack(packed, n))


@pytest.mark.parametrize("device", DEVICES)
def test_ten_million_odd_size_matches_numpy_and_round_trips(device):
    n = 10_000_019
    mask = random_mask((n,), seed=7)
    packed = pack_bits(mask.to(device))
    assert_same(packed, numpy_pack(mask))
    assert_same(unpack_bits(packed, n), mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES[:-1])
def test_unpack_of_pack_is_the_identity(device, n):
    mask = random_mask((2, n), seed=n, p=0.3).to(device)
    assert_same(unpack_bits(pack_bits(mask), n), mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 7, 9, 13, 63, 65, 1001])
def test_pack_bits_leaves_padding_bits_zero(device, n):
    packed = pack_bits(torch.ones(4, n, dtype=torch.bool, device=device))
    assert (packed[:, :-1] == 255).all()
    assert (packed[:, -1] == (1 << (n % 8 or 8)) - 1).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 7, 9, 13, 63, 65, 1001])
def test_unpack_bits_ignores_padding_bits(device, n):
    packed = random_bytes((3, (n + 7) // 8), seed=n)
    cleared = pack_bits(numpy_unpack(packed, n))
    assert_same(unpack_bits(packed.to(device), n), unpack_bits(cleared.to(device), n))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 5), (0, 0), (1, 9), (2, 0, 8), (2, 3, 0), (4, 3, 17), (2, 5, 64), (5, 1, 1, 24)])
def test_leading_dimensions_are_kept(device, shape):
    mask = random_mask(shape, seed=sum(shape))
    packed = pack_bits(mask.to(device))
    assert packed.shape == (*shape[:-1], (shape[-1] + 7) // 8)
    assert_same(packed, numpy_pack(mask))
    assert_same(unpack_bits(packed, shape[-1]), mask)


NON_CONTIGUOUS = {
    "transposed": lambda t: t.transpose(-1, -2),
    "strided_last_dim": lambda t: t[..., ::3],
    "sliced": lambda t: t[1:, 5:],
    "expanded": lambda t: t[:1].expand(4, -1),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("view", NON_CONTIGUOUS.values(), ids=NON_CONTIGUOUS.keys())
def test_non_contiguous_inputs_give_the_contiguous_result(device, view):
    mask = view(random_mask((40, 77), seed=3).to(device))
    packed_src = view(random_bytes((40, 77), seed=4).to(device))
    assert not mask.is_contiguous() and not packed_src.is_contiguous()
    assert_same(pack_bits(mask), numpy_pack(mask))
    n = packed_src.shape[-1] * 8 - 3
    assert_same(unpack_bits(packed_src, n), numpy_unpack(packed_src, n))
    assert_same(bitwise_or_reduce(packed_src), torch_or_reduce(packed_src))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0, 1, 2, 5])
@pytest.mark.parametrize("b", [0, 1, 7, 16, 33, 1001, 40_003])
def test_bitwise_or_reduce_matches_torch_oracle(device, p, b):
    packed = random_bytes((p, b), seed=p * 100_000 + b)
    assert_same(bitwise_or_reduce(packed.to(device)), torch_or_reduce(packed))


@pytest.mark.parametrize("device", DEVICES)
def test_bitwise_or_reduce_of_no_rows_is_zeros(device):
    assert_same(bitwise_or_reduce(torch.empty(0, 9, dtype=torch.uint8, device=device)),
                torch.zeros(9, dtype=torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_bitwise_or_reduce_of_packed_masks_is_the_packed_union(device):
    masks = random_mask((4, 1001), seed=11, p=0.1)
    union = bitwise_or_reduce(pack_bits(masks.to(device)))
    assert_same(unpack_bits(union, 1001), masks.any(dim=0))


def test_results_do_not_depend_on_the_cpu_thread_count():
    mask = random_mask((3, 1_000_001), seed=5)
    packed = random_bytes((3, 125_001), seed=6)
    rows = random_bytes((4, 2_000_003), seed=7)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append((pack_bits(mask), unpack_bits(packed, 1_000_001), bitwise_or_reduce(rows)))
    finally:
        torch.set_num_threads(before)
    for one, two in zip(*results):
        assert_same(one, two)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1,), (9,), (3, 13), (4, 3, 64), (2_000_003,), (5, 100_001)])
def test_cuda_and_cpu_results_are_bit_identical(shape):
    mask = random_mask(shape, seed=sum(shape))
    packed = pack_bits(mask)
    assert_same(pack_bits(mask.cuda()), packed)
    garbage = random_bytes(packed.shape, seed=1)
    assert_same(unpack_bits(garbage.cuda(), shape[-1]), unpack_bits(garbage, shape[-1]))
    rows = packed.reshape(-1, packed.shape[-1])
    assert_same(bitwise_or_reduce(rows.cuda()), bitwise_or_reduce(rows))


# ---- torch integration ----

@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_pack_bits(device):
    for mask in (random_mask((5,)), random_mask((3, 13)), random_mask((2, 3, 16)), random_mask((0, 4)),
                 random_mask((9, 20)).t()):
        torch.library.opcheck(torch.ops.fastdist.pack_bits.default, (mask.to(device),))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_unpack_bits(device):
    for packed, n in ((random_bytes((1,)), 5), (random_bytes((3, 2)), 13), (random_bytes((2, 3, 2)), 16),
                      (random_bytes((4, 0)), 0), (random_bytes((9, 3)).t(), 66)):
        torch.library.opcheck(torch.ops.fastdist.unpack_bits.default, (packed.to(device), n))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_bitwise_or_reduce(device):
    for packed in (random_bytes((3, 10)), random_bytes((1, 7)), random_bytes((0, 4)), random_bytes((6, 5)).t()):
        torch.library.opcheck(torch.ops.fastdist.bitwise_or_reduce.default, (packed.to(device),))


@pytest.mark.parametrize("device", DEVICES)
def test_ops_compile_with_fullgraph(device):
    def union_of_masks(a, b):
        packed = torch.stack([pack_bits(a), pack_bits(b)])
        return unpack_bits(bitwise_or_reduce(packed), a.shape[-1])

    compiled = torch.compile(union_of_masks, fullgraph=True)
    a, b = random_mask((1001,), seed=1).to(device), random_mask((1001,), seed=2).to(device)
    assert_same(compiled(a, b), a | b)


# ---- bitmap_from_indices ----

def random_indices(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, max(n, 1), (k,), generator=g) if n else torch.zeros(0, dtype=torch.int64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 33, 1000, 65_536, 1_000_003])
@pytest.mark.parametrize("k", [0, 1, 17, 5000])
def test_bitmap_from_indices_is_pack_bits_of_the_mask_set_at_the_indices(device, n, k):
    indices = random_indices(n, k if n else 0, seed=n + k)  # unsorted, with repeats where k is near n
    mask = torch.zeros(n, dtype=torch.bool)
    mask[indices] = True
    assert_same(bitmap_from_indices(indices.to(device), n), numpy_pack(mask))


@pytest.mark.parametrize("device", DEVICES)
def test_bitmap_from_a_sparse_gradients_indices_is_its_row_support(device):
    grad = torch.sparse_coo_tensor(torch.tensor([[5, 1, 5, 9]]), torch.ones(4, 3), (12, 3))  # uncoalesced, row 5 twice
    want = pack_bits(grad.to_dense().ne(0).any(1))
    assert_same(bitmap_from_indices(grad._indices()[0].to(device), 12), want)
    assert_same(bitmap_from_indices(grad.coalesce().indices()[0].to(device), 12), want)


def test_bitmap_from_indices_rejects_an_index_outside_the_units_on_cpu():
    for bad in (-1, 10, 2**62):
        with pytest.raises(RuntimeError, match=rf"'indices' must be in \[0, 10\) \(n = 10\), got {bad} at position 2"):
            bitmap_from_indices(torch.tensor([3, 4, bad, 1]), 10)


@pytest.mark.cuda
def test_cuda_bitmap_from_indices_skips_indices_outside_the_units():
    got = bitmap_from_indices(torch.tensor([3, -1, 10, 9, 2**62], device="cuda"), 10)
    assert_same(got, numpy_pack(torch.tensor([i in (3, 9) for i in range(10)])))


def test_bitmap_from_indices_does_not_depend_on_the_cpu_thread_count():
    indices = random_indices(1_000_003, 2_000_000, seed=3)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(bitmap_from_indices(indices, 1_000_003))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert_same(other, results[0])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_bitmap_from_indices(device):
    for indices, n in ((random_indices(50, 20), 50), (random_indices(9, 30), 9), (random_indices(0, 0), 0),
                       (random_indices(100, 40)[::2], 100)):
        torch.library.opcheck(torch.ops.fastdist.bitmap_from_indices.default, (indices.to(device), n))


# ---- bad inputs ----

BAD_INPUTS = {
    "pack_float_mask": (lambda d: pack_bits(torch.zeros(8, device=d)),
                        "'mask' must have dtype torch.bool, got torch.float32"),
    "pack_int_mask": (lambda d: pack_bits(torch.zeros(8, dtype=torch.int64, device=d)),
                      "'mask' must have dtype torch.bool, got torch.int64"),
    "pack_uint8_mask": (lambda d: pack_bits(torch.zeros(8, dtype=torch.uint8, device=d)),
                        "'mask' must have dtype torch.bool, got torch.uint8"),
    "pack_0d_mask": (lambda d: pack_bits(torch.tensor(True, device=d)),
                     r"'mask' must have at least 1 dimension\(s\), got shape \[\]"),
    "unpack_wrong_last_dim": (lambda d: unpack_bits(torch.zeros(3, 2, dtype=torch.uint8, device=d), 20),
                              r"'packed' must have last dimension 3 \(ceil\(n / 8\) for n = 20\), got shape \[3, 2\]"),
    "unpack_too_long_last_dim": (lambda d: unpack_bits(torch.zeros(4, dtype=torch.uint8, device=d), 8),
                                 r"'packed' must have last dimension 1 \(ceil\(n / 8\) for n = 8\), got shape \[4\]"),
    "unpack_negative_n": (lambda d: unpack_bits(torch.zeros(1, dtype=torch.uint8, device=d), -1),
                          "'n' must be >= 0, got -1"),
    "unpack_bool_packed": (lambda d: unpack_bits(torch.zeros(1, dtype=torch.bool, device=d), 8),
                           "'packed' must have dtype torch.uint8, got torch.bool"),
    "unpack_int32_packed": (lambda d: unpack_bits(torch.zeros(1, dtype=torch.int32, device=d), 8),
                            "'packed' must have dtype torch.uint8, got torch.int32"),
    "unpack_0d_packed": (lambda d: unpack_bits(torch.tensor(1, dtype=torch.uint8, device=d), 8),
                         r"'packed' must have at least 1 dimension\(s\), got shape \[\]"),
    "or_reduce_1d": (lambda d: bitwise_or_reduce(torch.zeros(5, dtype=torch.uint8, device=d)),
                     r"'packed' must have 2 dimension\(s\), got shape \[5\]"),
    "or_reduce_3d": (lambda d: bitwise_or_reduce(torch.zeros(2, 3, 4, dtype=torch.uint8, device=d)),
                     r"'packed' must have 2 dimension\(s\), got shape \[2, 3, 4\]"),
    "or_reduce_int64": (lambda d: bitwise_or_reduce(torch.zeros(2, 3, dtype=torch.int64, device=d)),
                        "'packed' must have dtype torch.uint8, got torch.int64"),
    "unpack_n_near_int64": (lambda d: unpack_bits(torch.zeros(1, dtype=torch.uint8, device=d), 2**63 - 1),
                            r"'packed' must have last dimension 1152921504606846976 \(ceil\(n / 8\) for "
                            r"n = 9223372036854775807\), got shape \[1\]"),
    "unpack_output_past_int64": (lambda d: unpack_bits(huge([2**61, 1], torch.uint8, d), 8),
                                 r"the output would have shape \[2305843009213693952, 8\] of torch.bool: its strides "
                                 r"or its size in bytes pass int64"),
    "pack_output_past_int64": (lambda d: pack_bits(huge([0, 2**62, 16], torch.bool, d)),
                               r"the output would have shape \[0, 4611686018427387904, 2\] of torch.uint8"),
    "from_indices_int32": (lambda d: bitmap_from_indices(torch.zeros(3, dtype=torch.int32, device=d), 8),
                           "'indices' must have dtype torch.int64, got torch.int32"),
    "from_indices_2d": (lambda d: bitmap_from_indices(torch.zeros(2, 3, dtype=torch.int64, device=d), 8),
                        r"'indices' must have 1 dimension\(s\), got shape \[2, 3\]"),
    "from_indices_negative_n": (lambda d: bitmap_from_indices(torch.zeros(0, dtype=torch.int64, device=d), -1),
                                "'n' must be >= 0, got -1"),
}


test_bad_inputs_raise_a_clear_error, test_fake_kernels_reject_bad_inputs_like_the_real_ones = \
    bad_input_tests(BAD_INPUTS)
