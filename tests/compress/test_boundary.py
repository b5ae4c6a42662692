"""fastdist.compress.Boundary: forward compression, the backward rule (mask reuse vs independent), inference, state."""
import math

import pytest
import torch
from torch import nn

from fastdist.compress import (AQSGD, Boundary, Chain, ErrorFeedback, Identity, MemoryStore, Quantize, TopK,
                               batch)
from helpers import randn


def test_forward_is_the_compressors_roundtrip():
    x = randn(4, 50)
    b = Boundary(fwd=TopK(0.1))
    want, packet = TopK(0.1).roundtrip(x)
    assert torch.equal(b(x), want)
    assert b.stats["fwd_dense_bytes"] == x.numel() * x.element_size()
    assert b.stats["fwd_wire_bytes"] == TopK(0.1).wire_bytes(packet) < b.stats["fwd_dense_bytes"]


def test_reuse_backward_is_the_exact_derivative_of_masking():
    x = randn(3, 40, seed=1).requires_grad_()
    w = randn(3, 40, seed=2)
    out = Boundary(fwd=TopK(0.2), backward_mask="reuse")(x)
    (out * w).sum().backward()
    mask = out.detach() != 0
    assert torch.equal(x.grad, torch.where(mask, w, torch.zeros(())))
    # and it is what autograd gives for the masking itself
    x2 = x.detach().clone().requires_grad_()
    (x2 * mask * w).sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_reuse_backward_sends_k_values_and_quantizes_only_them():
    rows, d = 4, 100
    x = randn(rows, d, seed=3).requires_grad_()
    b = Boundary(fwd=TopK(0.1), bwd=Quantize(8), backward_mask="reuse")
    out = b(x)
    g = randn(4, 100, seed=4)
    out.backward(g)
    mask = out.detach() != 0
    assert (x.grad[~mask] == 0).all()
    assert (x.grad[mask] - g[mask]).abs().max() <= (g[mask].max() - g[mask].min()) / 255
    k = math.ceil(0.1 * d)
    assert b.stats["bwd_wire_bytes"] == rows * (k + 2 * 4)  # per row: k one-byte codes, a float32 scale and zero


def test_independent_backward_compresses_the_whole_gradient_straight_through():
    x = randn(4, 100, seed=5).requires_grad_()
    b = Boundary(fwd=TopK(0.1), bwd=TopK(0.5), backward_mask="independent")
    out = b(x)
    g = randn(4, 100, seed=6)
    out.backward(g)
    assert torch.equal(x.grad, TopK(0.5).roundtrip(g)[0])
    fwd_mask = out.detach() != 0
    assert (x.grad[~fwd_mask] != 0).any()  # gradient flows where the forward dropped values


def test_quantized_forward_is_straight_through_for_the_gradient():
    x = randn(2, 16, seed=7).requires_grad_()
    Boundary(fwd=Quantize(2))(x).backward(torch.ones(2, 16))
    assert torch.equal(x.grad, torch.ones(2, 16))


def test_inference_is_uncompressed_unless_asked_and_never_touches_state():
    x = randn(2, 30, seed=8)
    ef = ErrorFeedback(TopK(0.1))
    b = Boundary(fwd=ef)
    b.train()
    b(x)
    residual = ef.residual.clone()
    b.eval()
    assert torch.equal(b(x), x)
    b.at_inference = True
    assert torch.equal(b(x), TopK(0.1).roundtrip(x)[0])
    assert torch.equal(ef.residual, residual)


def test_aqsgd_boundary_takes_sample_ids_from_the_batch_context_and_prefetches():
    store = MemoryStore(32)
    b = Boundary(fwd=AQSGD(Quantize(4), store), bwd=Quantize(8))
    x = randn(4, 20, seed=9)
    with batch(sample_ids=torch.arange(4), epoch=0):
        assert torch.equal(b(x), x)
    with batch(sample_ids=torch.arange(4), next_sample_ids=torch.arange(4), epoch=1):
        y = b(x + 0.01)
    assert b.fwd.epoch == 1 and store._pending is not None
    assert (y - (x + 0.01)).abs().max() < 0.01
    with pytest.raises(ValueError, match="sample ids are required"):
        b(x)


def test_boundaries_train_a_model_and_their_state_is_in_the_module_state_dict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), Boundary(fwd=ErrorFeedback(TopK(0.3)), bwd=Quantize(8)),
                          nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = randn(64, 8, seed=10)
    y = x.sum(1, keepdim=True)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.3 * losses[0]
    state = model.state_dict()
    clone = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), Boundary(fwd=ErrorFeedback(TopK(0.3)), bwd=Quantize(8)),
                          nn.Linear(32, 1))
    clone.load_state_dict(state)
    assert torch.equal(clone[2].fwd.residual, model[2].fwd.residual)


def test_identity_and_empty_boundaries_pass_through():
    x = randn(2, 5).requires_grad_()
    assert Boundary()(x) is x
    assert Boundary(fwd=Identity())(x) is x


@pytest.mark.parametrize("make, error, message", [
    (lambda: Boundary(fwd="topk"), TypeError, "'fwd' must be a fastdist.compress compressor"),
    (lambda: Boundary(bwd=AQSGD(Quantize(4), MemoryStore(2))), TypeError, "gradients are quantized directly"),
    (lambda: Boundary(fwd=TopK(0.1), backward_mask="mask"), ValueError, "'backward_mask' must be"),
])
def test_bad_boundaries_raise_clear_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_chain_forward_reuses_its_topk_mask_backward():
    x = randn(3, 60, seed=11).requires_grad_()
    out = Boundary(fwd=Chain(TopK(0.1), Quantize(8)))(x)
    out.backward(torch.ones(3, 60))
    assert torch.equal(x.grad != 0, out.detach() != 0)
