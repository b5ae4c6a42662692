"""fastdist.compress send/recv and StageBoundary across ranks (gloo, through fastdist.distributed.spawn): the
receiver sees exactly what a one-process Boundary computes, gradients come back, and mismatched configurations
raise on both ends instead of hanging."""
import math

import torch
import torch.distributed as dist
from torch import nn

from fastdist.compress import (AQSGD, Boundary, Chain, ErrorFeedback, Identity, MemoryStore, Quantize,
                               StageBoundary, TopK, recv, send)
from fastdist.distributed import MismatchError, spawn
from helpers import randn

TIMEOUT = 120
FRAME_OVERHEAD = 400  # bytes: the 16-byte prefix, the pickled header, the alignment padding


def _compressors():
    return [TopK(0.1), TopK(0.5, per="tensor"), Quantize(4), Quantize(2, "absmax", granularity=5),
            Chain(TopK(0.2), Quantize(8)), ErrorFeedback(TopK(0.1))]


def _send_recv_every_compressor():
    rank = dist.get_rank()
    out = []
    for i, c in enumerate(_compressors()):
        x = randn(6, 40, seed=i)
        if rank == 0:
            packet = send(x, 1, c)
            out.append(c.decompress(packet))
        else:
            out.append(recv(0, c))
    return out


def test_recv_returns_what_the_sender_would_decompress():
    sent, received = spawn(_send_recv_every_compressor, 2, backend="gloo", timeout=TIMEOUT)
    for a, b in zip(sent, received):
        assert torch.equal(a, b)


def _packets_of_changing_size(exact=False):
    """Packets through one Channel pair: small, then larger than the receive capacity (announced), then smaller
    again (one message into the grown buffer); and through fresh channels (send / recv). exact: every frame
    announced and received at its exact size, as on NCCL."""
    from fastdist.compress import p2p
    from fastdist.compress.p2p import Channel, recv_packet, send_packet

    if exact:
        p2p._exact_sizes = lambda device: True
    rank = dist.get_rank()
    channel = Channel()
    shapes = [(3, 5), (64, 1000), (2, 7), (64, 1000), (1,), (128, 1000)]
    out = []
    for i, shape in enumerate(shapes):
        packet = Identity().compress(randn(*shape, seed=i))
        packet.tensors["ids"] = torch.arange(3 if i else 0, dtype=torch.int64)  # an empty tensor first
        if rank == 0:
            out.append((send_packet(packet, 1, 7, channel=channel), packet.tensors))
        else:
            got = recv_packet(0, 7, channel=channel)
            out.append((channel.capacity, got.tensors))
    big = randn(300, 1000)
    out.append(send(big, 1, Identity()).tensors["x"] if rank == 0 else recv(0, Identity()))
    return out


def test_frames_sent_at_their_exact_size_arrive_intact():
    sent, received = spawn(_packets_of_changing_size, 2, True, backend="gloo", timeout=TIMEOUT)
    for (wire, want), (_, got) in zip(sent[:-1], received[:-1]):
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name])
        assert wire % 16 == 0 and wire > 16  # frame + its 16-byte announcement
    assert torch.equal(sent[-1], received[-1])


def test_frames_of_changing_size_arrive_intact_and_the_capacity_grows_on_both_ends():
    sent, received = spawn(_packets_of_changing_size, 2, backend="gloo", timeout=TIMEOUT)
    for (wire, want), (capacity, got) in zip(sent[:-1], received[:-1]):
        assert set(got) == set(want)
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name])
    # the first large frame is announced (16 bytes more on the wire) and becomes the capacity on both ends; the
    # same size again fits and goes as one message; the largest frame is announced again
    assert received[1][0] == sent[1][0] - 16 and sent[3][0] == sent[1][0] - 16
    assert received[-2][0] == sent[-2][0] - 16 > received[1][0]
    assert torch.equal(sent[-1], received[-1])


CONFIGS = (("reuse", 8), ("reuse", None), ("independent", 4))


def _two_stage_steps():
    return [_two_stage_step(mask, bits) for mask, bits in CONFIGS]


def _two_stage_step(backward_mask, bwd_bits):
    """Rank 0: Linear -> send; rank 1: recv -> Linear -> loss. Returns rank 0's weight gradient and the loss."""
    torch.manual_seed(0)
    first, second = nn.Linear(16, 64), nn.Linear(64, 1)
    x, y = randn(8, 16, seed=1), randn(8, 1, seed=2)
    bwd = Quantize(bwd_bits) if bwd_bits else None
    link = StageBoundary(0, 1, fwd=TopK(0.1), bwd=bwd, backward_mask=backward_mask)
    if dist.get_rank() == 0:
        link.send(first(x)).backward()
        return first.weight.grad, link.stats
    loss = ((second(link.recv()) - y) ** 2).mean()
    loss.backward()
    return float(loss), link.stats


def _one_process_step(backward_mask, bwd_bits):
    torch.manual_seed(0)
    first, second = nn.Linear(16, 64), nn.Linear(64, 1)
    x, y = randn(8, 16, seed=1), randn(8, 1, seed=2)
    boundary = Boundary(fwd=TopK(0.1), bwd=Quantize(bwd_bits) if bwd_bits else None, backward_mask=backward_mask)
    loss = ((second(boundary(first(x))) - y) ** 2).mean()
    loss.backward()
    return first.weight.grad, float(loss.detach())


def test_stage_boundary_gradients_equal_the_one_process_boundary():
    rank0, rank1 = spawn(_two_stage_steps, 2, backend="gloo", timeout=TIMEOUT)
    for (mask, bits), (grad, stats0), (loss, stats1) in zip(CONFIGS, rank0, rank1):
        want_grad, want_loss = _one_process_step(mask, bits)
        assert loss == want_loss
        assert torch.equal(grad, want_grad)
        assert stats0["fwd_wire_bytes"] < stats0["fwd_dense_bytes"] / 3
        if mask == "reuse":  # k values per row back (float32 at most), no indices, in one frame
            rows, k = 8, math.ceil(0.1 * 64)
            assert stats1["bwd_wire_bytes"] < rows * k * 4 + FRAME_OVERHEAD


def _mismatched_config():
    rank = dist.get_rank()
    try:
        StageBoundary(0, 1, fwd=TopK(0.1 if rank == 0 else 0.2), bwd=Quantize(8))
    except MismatchError as e:
        return str(e)
    return None


def test_a_mismatched_configuration_raises_on_both_ends_naming_the_field():
    messages = spawn(_mismatched_config, 2, backend="gloo", timeout=TIMEOUT)
    for m in messages:
        assert m is not None and "fwd.ratio" in m and "0.1" in m and "0.2" in m


def _four_stage_aqsgd_pipeline():
    """Ranks 0..3 in a chain; link 1->2 carries AQ-SGD activations. Returns each AQ-SGD end's store contents."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    block = nn.Linear(32, 32)
    links = {}
    for s in range(world - 1):
        if rank in (s, s + 1):
            fwd = AQSGD(Quantize(4), MemoryStore(16)) if s == 1 else Chain(TopK(0.25), Quantize(8))
            links[s] = StageBoundary(s, s + 1, fwd=fwd, bwd=Quantize(8))
    ids = torch.arange(4)
    losses = []
    for epoch in range(3):
        for link in links.values():
            if isinstance(link.fwd, AQSGD):
                link.fwd.set_epoch(epoch)
        h = randn(4, 32, seed=epoch) if rank == 0 else links[rank - 1].recv()
        h = torch.tanh(block(h))
        if rank < world - 1:
            links[rank].send(h, sample_ids=ids if rank == 1 else None).backward()
        else:
            loss = (h ** 2).mean()
            loss.backward()
            losses.append(float(loss))
    store = links[1].fwd.store.get(ids) if 1 in links else None
    return store, losses, block.weight.grad


def test_four_stage_pipeline_with_aqsgd_keeps_both_stores_identical():
    results = spawn(_four_stage_aqsgd_pipeline, 4, backend="gloo", timeout=TIMEOUT)
    assert torch.equal(results[1][0], results[2][0])
    for rank, (_, _, weight_grad) in enumerate(results):  # every stage got a gradient
        assert weight_grad is not None and weight_grad.abs().sum() > 0, f"rank {rank}"
    assert len(results[3][1]) == 3
