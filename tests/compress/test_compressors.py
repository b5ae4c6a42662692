"""fastdist.compress compressors: what each keeps, what it sends, its state, and its errors."""
import math
import pickle

import pytest
import torch
from torch import nn

from fastdist.compress import (AQSGD, EF21, Boundary, Chain, ErrorFeedback, Identity, MemoryStore, MmapStore,
                               Quantize, StoreFullError, TopK, batch)
from helpers import randn


def test_topk_keeps_exactly_the_k_largest_magnitudes_per_sample():
    x = randn(6, 5, 20)
    d = 5 * 20
    k = math.ceil(0.1 * d)
    y, packet = TopK(0.1).roundtrip(x)
    rows, out = x.reshape(6, d), y.reshape(6, d)
    assert y.shape == x.shape and packet.meta["k"] == k
    kept = out != 0
    assert (kept.sum(1) == k).all()
    assert torch.equal(out[kept], rows[kept])
    for r in range(6):
        assert rows[r].abs()[kept[r]].min() >= rows[r].abs()[~kept[r]].max()


def test_topk_per_tensor_keeps_the_k_largest_of_the_whole_tensor():
    x = randn(4, 50, seed=1)
    y, packet = TopK(0.05, per="tensor").roundtrip(x)
    assert (y != 0).sum() == math.ceil(0.05 * x.numel())
    assert y.abs().max() == x.abs().max() and (y != 0).sum(1).tolist() != [3, 3, 2, 2]  # rows need not share


@pytest.mark.parametrize("ratio, d, encoding", [(0.01, 1000, "indices"), (0.1, 1000, "bitmap"),
                                                (1 / 32, 1024, "indices"), (0.5, 64, "bitmap")])
def test_topk_picks_the_smaller_encoding_and_wire_bytes_count_it(ratio, d, encoding):
    packet = TopK(ratio).compress(randn(3, d))
    k = packet.meta["k"]
    assert (encoding in packet.tensors)
    index_bytes = 3 * (4 * k if encoding == "indices" else (d + 7) // 8)
    assert TopK(ratio).wire_bytes(packet) == 3 * 4 * k + index_bytes


def test_topk_forced_encodings_decode_to_the_same_tensor():
    x = randn(5, 300, seed=2)
    a = TopK(0.2, encoding="indices").roundtrip(x)[0]
    b = TopK(0.2, encoding="bitmap").roundtrip(x)[0]
    assert torch.equal(a, b)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("granularity", ["tensor", "row", 10])
def test_quantize_error_is_within_half_a_step_and_wire_bytes_are_codes_plus_scales(bits, granularity):
    x = randn(4, 40, seed=bits)
    c = Quantize(bits, granularity=granularity)
    y, packet = c.roundtrip(x)
    groups = {"tensor": 1, "row": x.shape[0], 10: x.numel() // 10}[granularity]
    assert c.wire_bytes(packet) == x.numel() * bits // 8 + 2 * 4 * groups  # codes, a float32 scale and zero each
    step = packet.tensors["scales"].repeat_interleave(x.numel() // groups).reshape(x.shape)
    assert ((y - x).abs() <= step / 2 + 1e-6).all()


def test_column_granularity_has_one_scale_per_feature():
    x = randn(16, 5, seed=7) * torch.tensor([0.01, 1.0, 100.0, 3.0, 0.5])  # features on very different scales
    c = Quantize(8, granularity="column")
    y, packet = c.roundtrip(x)
    assert packet.tensors["scales"].shape == (5,)
    step = (x.amax(0) - x.amin(0)) / 255
    assert ((y - x).abs() <= step / 2 + 1e-5 * x.abs()).all()
    per_row = Quantize(8, granularity="row").roundtrip(x)[0]
    assert (y - x)[:, 0].abs().max() < 0.01 * (per_row - x)[:, 0].abs().max()  # the small feature keeps its detail


def test_absmax_sends_no_zero_points():
    packet = Quantize(4, "absmax").compress(randn(2, 8))
    assert "zeros" not in packet.tensors


def test_stochastic_quantize_draws_fresh_numbers_each_call_and_restores_its_counter():
    c = Quantize(2, stochastic=True, seed=5)
    x = randn(4, 64)
    a, b = c.compress(x), c.compress(x)
    assert not torch.equal(a.tensors["packed"], b.tensors["packed"])
    state = c.state_dict()
    nxt = c.compress(x)
    c2 = Quantize(2, stochastic=True, seed=5)
    c2.load_state_dict(state)
    assert torch.equal(c2.compress(x).tensors["packed"], nxt.tensors["packed"])


def test_chain_quantizes_the_kept_values_only():
    x = randn(4, 200, seed=3)
    chain = Chain(TopK(0.1), Quantize(8))
    y, packet = chain.roundtrip(x)
    topk_only = TopK(0.1).roundtrip(x)[0]
    assert torch.equal(y != 0, topk_only != 0)
    assert (y - topk_only).abs().max() <= topk_only.abs().max() * 2 / 255
    assert chain.wire_bytes(packet) < TopK(0.1).wire_bytes(TopK(0.1).compress(x))


def test_error_feedback_residual_makes_the_running_sum_converge():
    # Sum of what was sent over T steps of a constant x: T x - e_T, with e_T bounded, so the mean converges to x
    x = randn(2, 100, seed=4)
    ef, plain = ErrorFeedback(TopK(0.05)), TopK(0.05)
    sent_ef = sum(ef.roundtrip(x)[0] for _ in range(400)) / 400
    sent_plain = sum(plain.roundtrip(x)[0] for _ in range(400)) / 400
    assert (sent_ef - x).norm() < 0.2 * (sent_plain - x).norm()
    assert torch.allclose(sent_ef * 400 + ef.residual, 400 * x, atol=1e-2)


def test_ef21_ends_track_the_same_estimate_and_it_converges_to_a_constant_input():
    x = randn(3, 50, seed=5)
    sender, receiver = EF21(TopK(0.1)), EF21(TopK(0.1))
    for _ in range(40):
        out = receiver.decompress(sender.compress(x))
    assert torch.equal(out, sender.sent)
    assert (out - x).norm() < 1e-3 * x.norm()


STATEFUL = {
    "error feedback": lambda path: ErrorFeedback(TopK(0.2)),
    "ef21": lambda path: EF21(Quantize(4)),
    "stochastic quantize": lambda path: Quantize(2, stochastic=True),
    "chain": lambda path: Chain(TopK(0.3), Quantize(2, stochastic=True)),
    "aqsgd, memory store": lambda path: AQSGD(Quantize(4), MemoryStore(8)),
    "aqsgd, file store": lambda path: AQSGD(Quantize(4), MmapStore(path, 8)),
}


def _step(c, n):
    """Step n of a run; an AQ-SGD compressor is left with the next batch's read in flight (prefetch)."""
    x = randn(4, 30, seed=n)
    if not isinstance(c, AQSGD):
        return c.roundtrip(x)[0]
    c.set_epoch(n)
    out = c.roundtrip(x, torch.arange(4))[0]
    c.prefetch(torch.arange(4))
    return out


@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_stateful_compressors_pickle_and_round_trip_their_state_mid_run(name, tmp_path):
    """A pickled copy and a fresh compressor given the state_dict continue exactly as a twin that ran alongside."""
    make = STATEFUL[name]
    original, twin = make(tmp_path / "original.bin"), make(tmp_path / "twin.bin")
    for n in range(3):
        _step(original, n)
        _step(twin, n)
    clone = pickle.loads(pickle.dumps(original))
    restored = make(tmp_path / "restored.bin")
    restored.load_state_dict(original.state_dict())
    for n in range(3, 5):
        want = _step(twin, n)
        assert torch.equal(_step(clone, n), want) and torch.equal(_step(restored, n), want), n


def test_a_model_with_an_aqsgd_boundary_pickles_while_a_prefetch_is_in_flight():
    model = nn.Sequential(nn.Linear(8, 16), Boundary(fwd=AQSGD(Quantize(4), MemoryStore(8))), nn.Linear(16, 1))
    ids, x = torch.arange(4), randn(4, 8)
    for epoch in range(2):
        with batch(sample_ids=ids, next_sample_ids=ids, epoch=epoch):
            model(x)
    clone = pickle.loads(pickle.dumps(model))
    with batch(sample_ids=ids, epoch=2):
        assert torch.equal(clone(x), model(x))


def test_feedback_shape_change_is_a_clear_error():
    ef = ErrorFeedback(TopK(0.5))
    ef.roundtrip(randn(4, 10))
    with pytest.raises(ValueError, match=r"residual has shape \(4, 10\) but the input has \(3, 10\)"):
        ef.roundtrip(randn(3, 10))
    ef.reset()
    ef.roundtrip(randn(3, 10))


# ---- AQ-SGD ----

def test_aqsgd_sends_first_visits_uncompressed_then_quantized_deltas():
    aq = AQSGD(Quantize(4), MemoryStore(16), warmup_epochs=1)
    x = randn(4, 64)
    ids = torch.tensor([3, 1, 7, 2])
    y, p = aq.roundtrip(x, ids)
    assert torch.equal(y, x) and p.meta["stale"] == 0
    aq.set_epoch(1)
    ids2 = torch.tensor([3, 1, 9, 2])  # 9 is new: sent in full
    x2 = x + 0.01 * randn(4, 64, seed=1)
    y2, p2 = aq.roundtrip(x2, ids2)
    assert p2.meta["stale"] == 3 and p2.tensors["full"].shape == (1, 64)
    assert torch.equal(y2[2], x2[2])
    # the delta is small, so its 4-bit error is much smaller than 4-bit quantization of the activation itself
    err_aq = (y2 - x2).norm()
    err_q = (Quantize(4).roundtrip(x2)[0] - x2).norm()
    assert err_aq < 0.1 * err_q
    assert AQSGD(Quantize(4), MemoryStore(1)).wire_bytes(p2) < AQSGD(Quantize(4), MemoryStore(1)).wire_bytes(p)


def test_aqsgd_sender_and_receiver_stores_stay_identical():
    sender, receiver = AQSGD(Quantize(2), MemoryStore(8)), AQSGD(Quantize(2), MemoryStore(8))
    ids = torch.arange(4)
    for epoch in range(4):
        sender.set_epoch(epoch)
        x = randn(4, 3, 5, seed=epoch)
        packet = sender.compress(x, ids)
        out = receiver.decompress(packet)
        assert out.shape == x.shape
        assert torch.equal(sender.store.get(ids), receiver.store.get(ids))
        assert torch.equal(out.reshape(4, -1), receiver.store.get(ids))


def test_aqsgd_without_sample_ids_or_with_bad_ones_is_a_clear_error():
    aq = AQSGD(Quantize(4), MemoryStore(8))
    with pytest.raises(ValueError, match="sample ids are required"):
        aq.compress(randn(2, 4))
    with pytest.raises(ValueError, match="got 3 sample ids for a batch of 2 samples"):
        aq.compress(randn(2, 4), torch.arange(3))
    with pytest.raises(ValueError, match="must be distinct"):
        aq.compress(randn(2, 4), torch.tensor([1, 1]))
    with pytest.raises(TypeError, match="1-D int32/int64 tensor"):
        aq.compress(randn(2, 4), torch.tensor([1.0, 2.0]))


def test_a_full_store_refuses_new_samples():
    aq = AQSGD(Quantize(4), MemoryStore(3))
    aq.compress(randn(2, 4), torch.tensor([0, 1]))
    with pytest.raises(StoreFullError, match=r"full: 2 of 3 slots used, 2 new sample id\(s\) do not fit"):
        aq.compress(randn(2, 4), torch.tensor([5, 6]))


def test_prefetch_returns_the_same_rows_as_a_direct_read():
    store = MemoryStore(10)
    store.put(torch.arange(5), randn(5, 7))
    want = store.get(torch.tensor([3, 1]))
    store.prefetch(torch.tensor([3, 1]))
    assert torch.equal(store.get(torch.tensor([3, 1])), want)
    store.prefetch(torch.tensor([2, 4]))
    assert torch.equal(store.get(torch.tensor([0])), store.data[0:1])  # other ids: a direct read


# ---- bad configurations and inputs ----

@pytest.mark.parametrize("make, error, message", [
    (lambda: TopK(0), ValueError, r"'ratio' must be in \(0, 1\]"),
    (lambda: TopK(1.5), ValueError, r"'ratio' must be in \(0, 1\]"),
    (lambda: TopK(0.1, per="row"), ValueError, "'per' must be"),
    (lambda: Quantize(3), ValueError, "'bits' must be 1, 2, 4 or 8, got 3"),
    (lambda: Quantize(4, scheme="max"), ValueError, "'scheme' must be"),
    (lambda: Quantize(4, granularity="columns"), ValueError, "'granularity' must be"),
    (lambda: Chain(TopK(0.1), Quantize(4, granularity="column")), ValueError, "per \"row\" or per \"tensor\""),
    (lambda: Chain(Quantize(4), TopK(0.1)), TypeError, r"expected Chain\(TopK\(...\), Quantize\(...\)\)"),
    (lambda: ErrorFeedback("topk"), TypeError, "expected a compressor"),
    (lambda: AQSGD(Quantize(4), {}), TypeError, "'store' must be a MemoryStore or MmapStore"),
    (lambda: MemoryStore(0), ValueError, "'capacity' must be an int >= 1"),
])
def test_bad_configurations_raise_clear_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize("c", [TopK(0.1), Quantize(4), Chain(TopK(0.1), Quantize(4)), Identity()])
def test_empty_and_integer_inputs_are_refused(c):
    with pytest.raises(ValueError, match="cannot compress an empty tensor"):
        c.compress(torch.zeros(0, 4))
    with pytest.raises(TypeError, match="expected a floating-point tensor"):
        c.compress(torch.ones(2, 4, dtype=torch.int64))


def test_nan_is_kept_by_topk_and_refused_by_quantize():
    x = torch.tensor([[1.0, float("nan"), 0.5, 2.0]])
    y, _ = TopK(0.25).roundtrip(x)
    assert y[0, 1].isnan() and (y[0, [0, 2, 3]] == 0).all()
    with pytest.raises(RuntimeError, match="'x' must be finite"):
        Quantize(8).compress(x)


def test_quantize_group_must_divide_the_row():
    with pytest.raises(ValueError, match="group size 7 must divide the row length 10"):
        Quantize(4, granularity=7).compress(randn(2, 10))


def test_non_contiguous_inputs_compress_like_their_contiguous_copy():
    x = randn(30, 8).t()
    for c in (TopK(0.2), Quantize(4), Chain(TopK(0.3), Quantize(8))):
        assert torch.equal(c.roundtrip(x)[0], c.roundtrip(x.contiguous())[0])
