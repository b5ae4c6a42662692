"""StageBoundary's running checks across ranks (gloo, through fastdist.distributed.spawn): a receiver whose EF21
estimate was lost or whose AQ-SGD store diverged raises (on both ends) before it returns a wrong activation, within
`check_every` messages; a backward skipped on one end raises instead of pairing one step's gradient with another's;
a link restored from a checkpoint on one end only raises; and a link pickles and round-trips its state."""
import pickle

import pytest
import torch
import torch.distributed as dist

from fastdist.compress import AQSGD, EF21, MemoryStore, Quantize, StageBoundary, TopK, recv, send
from fastdist.distributed import MismatchError, spawn, state_digest
from helpers import randn

TIMEOUT = 120
STEPS = 6
FAULT_BEFORE = 3  # the receiver's state is damaged before this step


def test_the_state_digest_changes_with_any_one_bit_and_not_with_layout_or_threads():
    t = randn(33, 17)  # 2244 bytes: 280 words and a 4-byte tail
    want = state_digest(t)
    assert torch.equal(state_digest(t.t().contiguous().t()), want)  # the same values in another memory layout
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(state_digest(t), want)
    finally:
        torch.set_num_threads(threads)
    raw = t.view(torch.uint8).reshape(-1)
    for byte in range(raw.numel()):
        flipped = raw.clone()
        flipped[byte] ^= 1 << (byte % 8)
        assert not torch.equal(state_digest(flipped.view(torch.float32)), want), byte


def _lose_the_ef21_estimate(link):
    link.fwd.load_state_dict(EF21(TopK(0.1)).state_dict())  # e.g. a fresh state loaded on this end only


def _diverge_one_aqsgd_entry(link):
    store, sample = link.fwd.store, torch.tensor([2])
    store.put(sample, store.get(sample) + 1e-3)


FAULTS = {
    "ef21 estimate lost": (lambda: EF21(TopK(0.1)), _lose_the_ef21_estimate),
    "aqsgd store diverged": (lambda: AQSGD(Quantize(4), MemoryStore(8)), _diverge_one_aqsgd_entry),
}


def _link_with_a_damaged_receiver(fault, check_every):
    """Rank 0 sends a changing activation through `fault`'s compressor for STEPS steps; rank 1's state is damaged
    before step FAULT_BEFORE. Returns (steps completed, the MismatchError's message or None, what rank 1 received)."""
    make, damage = FAULTS[fault]
    rank = dist.get_rank()
    link = StageBoundary(0, 1, fwd=make(), bwd=Quantize(8), check_every=check_every)
    ids, received, done = torch.arange(4), [], 0
    try:
        for step in range(STEPS):
            if isinstance(link.fwd, AQSGD):
                link.fwd.set_epoch(step)
            if rank == 0:
                link.send(randn(4, 64, seed=step).requires_grad_(), sample_ids=ids).backward()
            else:
                if step == FAULT_BEFORE:
                    damage(link)
                x = link.recv()
                received.append(x.detach().clone())
                x.sum().backward()
            done += 1
    except MismatchError as e:
        return done, str(e), received
    return done, None, received


def _one_process_outputs(fault, steps):
    c = FAULTS[fault][0]()
    out = []
    for step in range(steps):
        x = randn(4, 64, seed=step)
        if isinstance(c, AQSGD):
            c.set_epoch(step)
            out.append(c.roundtrip(x, torch.arange(4))[0])
        else:
            out.append(c.roundtrip(x)[0])
    return out


@pytest.mark.parametrize("check_every", [1, 4])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_damaged_receiver_state_raises_on_both_ends_within_check_every_messages(fault, check_every):
    (sent, sender_error, _), (got, receiver_error, received) = spawn(
        _link_with_a_damaged_receiver, 2, fault, check_every, backend="gloo", timeout=TIMEOUT)
    first_checked = -(-FAULT_BEFORE // check_every) * check_every
    assert sent == got == first_checked  # the receiver raised in the recv of that step, the sender in its backward
    assert sender_error == receiver_error
    assert sender_error is not None and "diverged" in sender_error and f"activation {first_checked}" in sender_error
    for step, (x, want) in enumerate(zip(received, _one_process_outputs(fault, FAULT_BEFORE))):
        assert torch.equal(x, want), step  # until the damage, the link returns what one process computes


def _gpipe_steps_with_a_skipped_backward():
    """Two micro-batches per step, forwards then backwards (last first); in step 1 rank 1 skips the backward of
    micro-batch 1 (say, its loss was not finite). Returns (steps completed, the MismatchError's message or None)."""
    rank = dist.get_rank()
    link = StageBoundary(0, 1, fwd=TopK(0.5), bwd=Quantize(8))
    done = 0
    try:
        for step in range(3):
            if rank == 0:
                tokens = [link.send(randn(4, 16, seed=2 * step + m).requires_grad_()) for m in range(2)]
                for token in reversed(tokens):
                    token.backward()
            else:
                losses = [(link.recv() ** 2).sum() for _ in range(2)]
                for m in reversed(range(2)):
                    if not (step == 1 and m == 1):
                        losses[m].backward()
            done += 1
    except MismatchError as e:
        return done, str(e)
    return done, None


def test_a_backward_skipped_on_one_end_raises_on_both_instead_of_pairing_the_wrong_gradients():
    (sender_done, sender_error), (receiver_done, receiver_error) = spawn(
        _gpipe_steps_with_a_skipped_backward, 2, backend="gloo", timeout=TIMEOUT)
    # the sender's backward of activation 3 (step 1, micro-batch 1) got activation 2's gradient and raised; the
    # receiver finished step 1 and raised at its next receive
    assert (sender_done, receiver_done) == (1, 2)
    assert sender_error == receiver_error
    assert "gradient order" in sender_error and "gradient of activation 2" in sender_error \
        and "expected the gradient of activation 3" in sender_error


def _steps(link, first, last):
    rank, out = dist.get_rank(), []
    for step in range(first, last):
        if rank == 0:
            y = randn(4, 32, seed=step).requires_grad_()
            link.send(y * 2).backward()
            out.append(y.grad)
        else:
            x = link.recv()
            (x * randn(4, 32, seed=100 + step)).sum().backward()
            out.append(x.detach().clone())
    return out


def _checkpointed_link(restore_on):
    """Two steps, a checkpoint, two more; then the ranks in `restore_on` load the checkpoint and step again.
    Returns (the steps after the checkpoint, by a pickled copy of the link; the steps after the restore, or the
    MismatchError's message)."""
    link = StageBoundary(0, 1, fwd=EF21(TopK(0.25)), bwd=Quantize(8, stochastic=True))
    _steps(link, 0, 2)
    state = pickle.loads(pickle.dumps(link.state_dict()))
    copy = pickle.loads(pickle.dumps(link))
    after_checkpoint = _steps(copy, 2, 4)
    if dist.get_rank() in restore_on:
        link.load_state_dict(state)
    else:
        link = copy
    try:
        return after_checkpoint, _steps(link, 2, 4)
    except MismatchError as e:
        return after_checkpoint, str(e)


def test_a_link_pickles_and_both_ends_restored_from_one_checkpoint_repeat_its_steps():
    for by_copy, after_restore in spawn(_checkpointed_link, 2, (0, 1), backend="gloo", timeout=TIMEOUT):
        assert len(after_restore) == 2
        for a, b in zip(by_copy, after_restore):
            assert torch.equal(a, b)


def test_a_link_restored_on_one_end_only_raises_on_both():
    (_, sender_error), (_, receiver_error) = spawn(_checkpointed_link, 2, (0,), backend="gloo", timeout=TIMEOUT)
    assert sender_error == receiver_error
    assert "activation call number" in sender_error and "rank 0: 2" in sender_error and "rank 1: 4" in sender_error


def _recv_after_the_receiver_lost_its_estimate():
    c = EF21(Quantize(4))
    for step in range(3):
        if dist.get_rank() == 0:
            send(randn(4, 8, seed=step), 1, c)
        else:
            if step == 2:
                c.reset()
            try:
                recv(0, c)
            except MismatchError as e:
                return step, str(e)
    return None


def test_plain_recv_raises_when_the_ends_compressor_states_diverged():
    _, (step, message) = spawn(_recv_after_the_receiver_lost_its_estimate, 2, backend="gloo", timeout=TIMEOUT)
    assert step == 2 and "diverged" in message


def _unpickled_link_on_a_subgroup():
    group = dist.new_group([0, 1])
    link = pickle.loads(pickle.dumps(StageBoundary(0, 1, group=group)))
    try:
        link.send(torch.ones(2)) if dist.get_rank() == 0 else link.recv()
    except RuntimeError as e:
        return str(e)
    return None


def test_an_unpickled_link_on_a_subgroup_asks_for_its_group():
    for message in spawn(_unpickled_link_on_a_subgroup, 2, backend="gloo", timeout=TIMEOUT):
        assert "unpickled without its process group" in message
