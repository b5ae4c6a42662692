"""fastdist.ops.moe_route / moe_layout / moe_permute / moe_unpermute against plain-Python and torch oracles, their
autograd (gradcheck and a torch reference), opcheck, determinism across thread counts, and bad inputs."""
import pytest
import torch
from fastdist.ops import moe_layout, moe_permute, moe_route, moe_unpermute
from fastdist.ops.moe import capacity_for
from op_testing import DEVICES, bad_input_tests, huge

# ---- oracles ----

def oracle_layout(topk_idx, num_experts, num_ranks, capacity):
    """The stable sort by expert in priority order (all first choices, then all second choices), in plain Python."""
    tokens, k = topk_idx.shape
    ids = topk_idx.tolist()
    by_expert = [[] for _ in range(num_experts)]
    for j in range(k):
        for t in range(tokens):
            by_expert[ids[t][j]].append(t * k + j)
    counts = [len(s) for s in by_expert]
    kept = [s if capacity < 0 else s[:capacity] for s in by_expert]
    dropped = [[] if capacity < 0 else s[capacity:] for s in by_expert]
    permutation = [slot for s in kept for slot in s] + [slot for s in dropped for slot in s]
    offsets = [0]
    for s in kept:
        offsets.append(offsets[-1] + len(s))
    row_of_slot = [[-1] * k for _ in range(tokens)]
    position = [[0] * k for _ in range(tokens)]
    for e in range(num_experts):
        for pos, slot in enumerate(by_expert[e]):
            t, j = divmod(slot, k)
            position[t][j] = pos
            if capacity < 0 or pos < capacity:
                row_of_slot[t][j] = offsets[e] + pos
    per_rank = num_experts // num_ranks
    rank_counts = [offsets[(r + 1) * per_rank] - offsets[r * per_rank] for r in range(num_ranks)]
    as_long = lambda v: torch.tensor(v, dtype=torch.int64).reshape(-1)
    return (as_long(counts), as_long(offsets), as_long(rank_counts), as_long(permutation),
            as_long(row_of_slot).reshape(tokens, k), as_long(position).reshape(tokens, k),
            (as_long(row_of_slot).reshape(tokens, k) >= 0))


def compute_dtype(dtype):
    """16-bit rows are computed in float32 and rounded once, as the kernels document."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def oracle_permute(x, row_of_slot, num_rows, weight=None):
    acc = compute_dtype(x.dtype)
    out = torch.zeros(num_rows, x.shape[1], dtype=x.dtype)
    for t in range(x.shape[0]):
        for j in range(row_of_slot.shape[1]):
            r = int(row_of_slot[t, j])
            if r >= 0:
                out[r] = (x[t].to(acc) * (1 if weight is None else weight[t, j].to(acc))).to(x.dtype)
    return out


def oracle_unpermute(y, row_of_slot, weight=None):
    tokens, k = row_of_slot.shape
    acc = compute_dtype(y.dtype)
    out = torch.zeros(tokens, y.shape[1], dtype=acc)
    for t in range(tokens):
        for j in range(k):
            r = int(row_of_slot[t, j])
            if r >= 0:
                out[t] += y[r].to(acc) * (1 if weight is None else weight[t, j].to(acc))
    return out.to(y.dtype)


def random_ids(tokens, k, num_experts, seed=0, skew=None):
    """k distinct experts per token, drawn with popularity ~ Zipf(skew) when skew is given, else uniform."""
    g = torch.Generator().manual_seed(seed)
    popularity = torch.ones(num_experts) if skew is None else 1.0 / torch.arange(1, num_experts + 1) ** skew
    return torch.multinomial(popularity.expand(tokens, -1), k, replacement=False, generator=g) if tokens else \
        torch.empty(0, k, dtype=torch.int64)


def assert_layout_equal(got, want):
    names = ["counts", "offsets", "rank_counts", "permutation", "row_of_slot", "position", "keep"]
    for name, g, w in zip(names, got, want):
        assert torch.equal(g.cpu(), w), f"{name}: got {g} want {w}"


# ---- moe_route ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tokens, experts, k", [(0, 4, 2), (1, 1, 1), (7, 4, 2), (100, 33, 3), (64, 128, 8)])
def test_route_matches_softmax_and_topk(device, dtype, tokens, experts, k):
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens), dtype=dtype)
    probs, lse, idx, weight = moe_route(logits.to(device), k)
    want_probs = logits.double().softmax(-1)
    assert probs.dtype == torch.float32 and idx.dtype == torch.int64 and weight.dtype == torch.float32
    torch.testing.assert_close(probs.cpu().double(), want_probs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lse.cpu().double(), logits.double().logsumexp(-1), rtol=1e-6, atol=1e-6)
    assert torch.equal(idx.cpu(), want_probs.topk(k, dim=-1).indices)  # random logits: no ties
    assert torch.equal(weight.cpu(), probs.cpu().gather(1, idx.cpu()))


@pytest.mark.parametrize("device", DEVICES)
def test_route_breaks_ties_toward_the_lower_expert_id(device):
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 2.0, 1.0], [5.0, 1.0, 5.0, 5.0]], device=device)
    _, _, idx, _ = moe_route(logits, 3)
    assert idx.cpu().tolist() == [[0, 1, 2], [1, 2, 0], [0, 2, 3]]


@pytest.mark.parametrize("bad", ["nan", "+inf", "all -inf"])
def test_route_rejects_rows_without_a_softmax(bad):
    logits = torch.zeros(3, 4)
    if bad == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, 2] = float(bad)
    with pytest.raises(RuntimeError, match="'logits' rows must hold no NaN and a finite maximum .* got 1 row"):
        moe_route(logits, 1)


def test_route_accepts_minus_inf_as_a_masked_expert():
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]])
    probs, _, idx, _ = moe_route(logits, 2)
    assert idx.tolist() == [[2, 0]]
    assert probs[0, 1] == 0 and probs[0, 3] == 0


@pytest.mark.cuda
def test_route_on_cuda_gives_distinct_valid_experts_for_rows_without_a_softmax():
    logits = torch.zeros(3, 40, device="cuda")
    logits[0] = float("-inf")
    logits[1, 7] = float("inf")
    logits[2, 5] = float("nan")
    _, _, idx, _ = moe_route(logits, 3)
    for row in idx.cpu().tolist():
        assert len(set(row)) == 3 and all(0 <= e < 40 for e in row)


@pytest.mark.parametrize("device", DEVICES)
def test_route_backward_matches_torch_softmax_topk_autograd(device):
    logits = torch.randn(20, 6, generator=torch.Generator().manual_seed(1), device="cpu").to(device)
    a = logits.clone().requires_grad_()
    probs, lse, idx, weight = moe_route(a, 2)
    g = torch.Generator().manual_seed(2)
    gp, gl, gw = torch.randn(20, 6, generator=g), torch.randn(20, generator=g), torch.randn(20, 2, generator=g)
    ((probs * gp.to(device)).sum() + (lse * gl.to(device)).sum() + (weight * gw.to(device)).sum()).backward()
    b = logits.clone().requires_grad_()
    ref_probs = b.softmax(-1)
    ref = (ref_probs * gp.to(device)).sum() + (b.logsumexp(-1) * gl.to(device)).sum() + \
        (ref_probs.gather(1, idx) * gw.to(device)).sum()
    ref.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


# ---- moe_layout ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens, k, experts, ranks", [(0, 2, 4, 2), (1, 1, 1, 1), (9, 2, 4, 2), (50, 2, 8, 4),
                                                       (300, 3, 16, 4), (1000, 1, 6, 3)])
@pytest.mark.parametrize("capacity", [-1, 0, 1, 5, 1000])
def test_layout_is_the_stable_sort_in_priority_order(device, tokens, k, experts, ranks, capacity):
    ids = random_ids(tokens, k, experts, seed=tokens + k, skew=1.2)
    got = moe_layout(ids.to(device), experts, ranks, capacity)
    assert_layout_equal(got, oracle_layout(ids, experts, ranks, capacity))


def test_layout_drops_second_choices_before_any_first_choice():
    # Tokens 0, 1 choose (0, 1), tokens 2, 3 choose (1, 0): with capacity 2 every first choice fits, no second does.
    ids = torch.tensor([[0, 1], [0, 1], [1, 0], [1, 0]])
    counts, offsets, _, permutation, row_of_slot, position, keep = moe_layout(ids, 2, 1, 2)
    # Expert 0: first choices of tokens 0, 1 (positions 0, 1), then second choices of tokens 2, 3 (dropped).
    assert position[:, 0].tolist() == [0, 1, 0, 1] and position[:, 1].tolist() == [2, 3, 2, 3]
    assert keep[:, 0].all() and not keep[:, 1].any() and (row_of_slot[:, 1] == -1).all()
    assert counts.tolist() == [4, 4] and offsets.tolist() == [0, 2, 4]
    assert permutation[:4].tolist() == [0, 2, 4, 6]


def test_layout_does_not_depend_on_the_thread_count():
    ids = random_ids(50_000, 2, 64, seed=3, skew=1.2)  # 100k assignments: several chunks with 2 threads
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = moe_layout(ids, 64, 8, 1500)
        torch.set_num_threads(max(2, before))
        many = moe_layout(ids, 64, 8, 1500)
    finally:
        torch.set_num_threads(before)
    assert_layout_equal(many, one)
    assert_layout_equal(one, oracle_layout(ids, 64, 8, 1500))


def test_capacity_for_follows_the_formula():
    assert capacity_for(1000, 8, 2, 1.25) == 313
    assert capacity_for(3, 64, 1, 1.0) == 4
    assert capacity_for(3, 64, 1, 1.0, min_capacity=0) == 1


# ---- moe_permute / moe_unpermute ----

def layout_case(tokens, k, experts, capacity, d, dtype, seed=0):
    ids = random_ids(tokens, k, experts, seed=seed, skew=1.0)
    _, offsets, _, _, row_of_slot, _, _ = moe_layout(ids, experts, 1, capacity)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, d, generator=g, dtype=torch.float64).to(dtype)
    w = torch.rand(tokens, k, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(int(offsets[-1]), d, generator=g, dtype=torch.float64).to(dtype)
    return x, y, w, row_of_slot, int(offsets[-1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_rows_round_to_nearest_even_and_keep_special_values(dtype):
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-7, -3e-6, 65504.0, 1 / 3],
                            dtype=torch.float32)
    x = specials.to(dtype).reshape(-1, 1)
    row_of_slot = torch.arange(x.shape[0]).reshape(-1, 1)
    weight = torch.full((x.shape[0], 1), 1.5, dtype=dtype)
    got = moe_permute(x, row_of_slot, x.shape[0], weight)
    want = (x.float() * 1.5).to(dtype)  # torch's float -> 16-bit conversion rounds to nearest even
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])
    back = moe_unpermute(x, row_of_slot, weight)
    assert torch.equal(back.isnan(), want.isnan()) and torch.equal(back[~back.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens, k, experts, capacity, d", [(0, 2, 4, -1, 8), (1, 1, 1, -1, 1), (17, 2, 4, 3, 5),
                                                             (64, 2, 8, -1, 33), (40, 4, 8, 12, 16), (10, 2, 4, 0, 3)])
@pytest.mark.parametrize("weighted", [False, True])
def test_permute_and_unpermute_match_the_oracles(device, dtype, tokens, k, experts, capacity, d, weighted):
    x, y, w, row_of_slot, rows = layout_case(tokens, k, experts, capacity, d, dtype)
    weight = w if weighted else None
    to = (lambda t: None if t is None else t.to(device))
    got_p = moe_permute(to(x), to(row_of_slot), rows, to(weight))
    got_u = moe_unpermute(to(y), to(row_of_slot), to(weight))
    assert got_p.dtype == dtype and got_u.dtype == dtype
    torch.testing.assert_close(got_p.cpu(), oracle_permute(x, row_of_slot, rows, weight), rtol=0, atol=0)
    torch.testing.assert_close(got_u.cpu(), oracle_unpermute(y, row_of_slot, weight))


def test_unpermute_of_permute_sums_each_tokens_kept_weights():
    x, _, w, row_of_slot, rows = layout_case(30, 2, 4, 5, 7, torch.float64)
    back = moe_unpermute(moe_permute(x, row_of_slot, rows), row_of_slot, w)
    kept_weight = torch.where(row_of_slot >= 0, w, 0).sum(1, keepdim=True)
    torch.testing.assert_close(back, x * kept_weight)


def test_permute_and_unpermute_of_non_contiguous_inputs():
    x, y, w, row_of_slot, rows = layout_case(12, 2, 4, -1, 6, torch.float32)
    xt = x.t().contiguous().t()
    assert not xt.is_contiguous()
    torch.testing.assert_close(moe_permute(xt, row_of_slot, rows), oracle_permute(x, row_of_slot, rows))
    wt = w.t().contiguous().t()
    torch.testing.assert_close(moe_unpermute(y, row_of_slot, wt), oracle_unpermute(y, row_of_slot, w))


def test_unpermute_does_not_depend_on_the_thread_count():
    _, y, w, row_of_slot, _ = layout_case(4000, 2, 16, -1, 64, torch.float32, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = moe_unpermute(y, row_of_slot, w)
        torch.set_num_threads(max(2, before))
        many = moe_unpermute(y, row_of_slot, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cuda_unpermute_is_bit_identical_to_cpu(dtype):
    _, y, w, row_of_slot, _ = layout_case(4000, 2, 16, -1, 64, dtype, seed=6)
    assert torch.equal(moe_unpermute(y.cuda(), row_of_slot.cuda(), w.cuda()).cpu(), moe_unpermute(y, row_of_slot, w))


@pytest.mark.cuda
def test_cuda_route_layout_and_permute_on_a_side_stream_match_cpu():
    logits = torch.randn(3000, 16, generator=torch.Generator().manual_seed(2))
    x = torch.randn(3000, 32, generator=torch.Generator().manual_seed(3))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # inputs made on the side stream: ops on another stream would race them
        logits_d, x_d = logits.cuda() * 1, x.cuda() * 1
        _, _, idx_d, w_d = moe_route(logits_d, 2)
        layout_d = moe_layout(idx_d, 16, 4, 400)
        out_d = moe_unpermute(moe_permute(x_d, layout_d[4], int(layout_d[1][-1])), layout_d[4], w_d)
    stream.synchronize()
    _, _, idx, w = moe_route(logits, 2)
    layout = moe_layout(idx, 16, 4, 400)
    assert torch.equal(idx_d.cpu(), idx)
    assert_layout_equal([t.cpu() for t in layout_d], layout)
    torch.testing.assert_close(out_d.cpu(), moe_unpermute(moe_permute(x, layout[4], int(layout[1][-1])), layout[4], w))


@pytest.mark.parametrize("capacity", [-1, 3])
def test_permute_and_unpermute_gradcheck(capacity):
    x, y, w, row_of_slot, rows = layout_case(9, 2, 4, capacity, 3, torch.float64, seed=2)
    x, y, w = x.requires_grad_(), y.requires_grad_(), w.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: moe_permute(a, row_of_slot, rows, b), (x, w))
    assert torch.autograd.gradcheck(lambda a, b: moe_unpermute(a, row_of_slot, b), (y, w))
    assert torch.autograd.gradcheck(lambda a: moe_unpermute(a, row_of_slot), (y,))


def test_route_gradcheck_in_float64():
    logits = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    # probs are stored in float32, so finite differences see float32 rounding: eps and tolerances fit that.
    assert torch.autograd.gradcheck(lambda a: [o for i, o in enumerate(moe_route(a, 2)) if i != 2], (logits,),
                                    eps=1e-3, atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, y, w, row_of_slot, rows = layout_case(11, 2, 4, 3, 5, torch.float32)
    to = (lambda t: t.to(device))
    logits = torch.randn(11, 4, device=device)
    cases = [
        (torch.ops.fastdist.moe_route.default, (logits, 2)),
        (torch.ops.fastdist.moe_layout.default, (random_ids(11, 2, 4).to(device), 4, 2, 3)),
        (torch.ops.fastdist.moe_permute.default, (to(x).requires_grad_(), to(row_of_slot), rows, to(w))),
        (torch.ops.fastdist.moe_permute.default, (to(x), to(row_of_slot), rows, None)),
        (torch.ops.fastdist.moe_unpermute.default, (to(y).requires_grad_(), to(row_of_slot), to(w).requires_grad_())),
        (torch.ops.fastdist.moe_unpermute.default, (to(y).bfloat16(), to(row_of_slot), to(w).bfloat16())),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


# ---- bad inputs ----

@pytest.mark.parametrize("call, message", [
    (lambda: moe_route(torch.zeros(3, 4, dtype=torch.int32), 1), "'logits' must have dtype torch.float32 or"),
    (lambda: moe_route(torch.zeros(3), 1), "'logits' must have 2 dimension"),
    (lambda: moe_route(torch.zeros(3, 4), 5), r"'k' must be in \[1, min\(16, num_experts = 4\)\], got 5"),
    (lambda: moe_route(torch.zeros(3, 4), 0), "'k' must be in"),
    (lambda: moe_layout(torch.zeros(3, 2, dtype=torch.int32), 4), "'topk_idx' must have dtype torch.int64"),
    (lambda: moe_layout(torch.zeros(3, 2, dtype=torch.int64), 4, 3), "'num_ranks' must be >= 1 and divide"),
    (lambda: moe_layout(torch.zeros(3, 2, dtype=torch.int64), 4, 1, -2), "'capacity' must be >= 0, or -1"),
    (lambda: moe_layout(torch.full((3, 2), 4, dtype=torch.int64), 4), r"'topk_idx' entries must be in \[0, num_"),
    (lambda: moe_layout(torch.full((3, 2), -1, dtype=torch.int64), 4), r"'topk_idx' entries must be in \[0, num_"),
    (lambda: moe_permute(torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 1, dtype=torch.int64), 3),
     r"'x' must have a floating dtype \(torch.float32, torch.float64, torch.float16 or torch.bfloat16\)"),
    (lambda: moe_route(torch.zeros(3, 4, dtype=torch.bfloat16), 1), "'logits' must have dtype torch.float32 or"),
    (lambda: moe_permute(torch.zeros(3, 2), torch.zeros(4, 1, dtype=torch.int64), 3), "'row_of_slot' must have 3 rows"),
    (lambda: moe_permute(torch.zeros(3, 2), torch.full((3, 1), 3, dtype=torch.int64), 3),
     r"'row_of_slot' entries must be in \[-1, 3\)"),
    (lambda: moe_permute(torch.zeros(3, 2), torch.zeros(3, 1, dtype=torch.int64), 3, torch.zeros(3, 1).double()),
     "'weight' must have the dtype of 'x'"),
    (lambda: moe_unpermute(torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 1)),
     "'weight' must have the shape of 'row_of_slot'"),
    (lambda: moe_unpermute(torch.zeros(3, 2), torch.full((2, 1), -2, dtype=torch.int64)),
     r"'row_of_slot' entries must be in \[-1, 3\)"),
])
def test_bad_inputs_raise_a_clear_error(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("device", DEVICES)
def test_permute_rejects_a_row_named_by_two_slots(device):
    x = torch.randn(3, 2, device=device)
    for rows, twice in (([[0, 2], [1, -1], [2, -1]], 2), ([[1], [1], [0]], 1), ([[0, 0], [-1, -1], [-1, 1]], 0)):
        with pytest.raises(RuntimeError, match=rf"'row_of_slot' must name each row at most once \(moe_permute writes "
                                               rf"a row from one slot\), got row {twice} more than once"):
            moe_permute(x, torch.tensor(rows, device=device), 3)


@pytest.mark.parametrize("device", DEVICES)
def test_unpermute_gathers_a_row_named_by_two_slots_for_both(device):
    y = torch.randn(3, 4, device=device)
    rows = torch.tensor([[2, 2], [0, -1]], device=device)
    out = moe_unpermute(y, rows, torch.tensor([[1.0, 0.5], [2.0, 3.0]], device=device))
    torch.testing.assert_close(out.cpu(), torch.stack([1.5 * y[2], 2.0 * y[0]]).cpu())


SIZES_PAST_INT64 = {
    "layout_histogram": (lambda d: moe_layout(torch.empty(0, 2**62, dtype=torch.int64, device=d), 4, 1, -1),
                         r"the layout's histogram \(choices x experts\) would have shape \[4611686018427387904, 4\] "
                         r"of torch.int64: its strides or its size in bytes pass int64"),
    "layout_counts": (lambda d: moe_layout(torch.zeros(3, 2, dtype=torch.int64, device=d), 2**62),
                      r"the output 'counts' would have shape \[4611686018427387904\] of torch.int64"),
    "layout_offsets": (lambda d: moe_layout(torch.zeros(3, 2, dtype=torch.int64, device=d), 2**60 - 1),
                       r"the output 'offsets' would have shape \[1152921504606846976\] of torch.int64"),
    "permute_output": (lambda d: moe_permute(torch.empty(0, 2**62, device=d),
                                             torch.empty(0, 1, dtype=torch.int64, device=d), 2),
                       r"the output would have shape \[2, 4611686018427387904\] of torch.float32"),
    "unpermute_output": (lambda d: moe_unpermute(torch.empty(0, 2**62, device=d),
                                                 torch.full((2, 1), -1, dtype=torch.int64, device=d)),
                         r"the output would have shape \[2, 4611686018427387904\] of torch.float32"),
    "permute_output_bytes": (lambda d: moe_permute(huge([1, 2**61], torch.bfloat16, d),
                                                   torch.zeros(1, 1, dtype=torch.int64, device=d), 2),
                             r"the output would have shape \[2, 2305843009213693952\] of torch.bfloat16"),
}

test_sizes_past_int64_raise_a_clear_error, test_fake_kernels_reject_sizes_past_int64_like_the_real_ones = \
    bad_input_tests(SIZES_PAST_INT64)
