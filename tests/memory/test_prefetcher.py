"""SwapPrefetcher: bitwise-equal gradients, memory really released, views once, prefetch ahead, cleanup."""
import copy
import gc
import itertools
import os

import pytest
import torch
from fastdist.memory import SwapPrefetcher
from memory_models import loss_of, make
from torch.multiprocessing.reductions import StorageWeakRef


def grads_of(model, x, prefetcher=None, seed=1):
    """Parameter gradients of one step (dropout seeded), optionally with saved tensors in `prefetcher`."""
    model = copy.deepcopy(model)
    torch.manual_seed(seed)
    if prefetcher is None:
        loss = loss_of(model(x))
    else:
        with prefetcher:
            loss = loss_of(model(x))
    loss.backward()
    return [p.grad for p in model.parameters()]


def swap_files(directory):
    return [n for n in os.listdir(directory) if n.startswith("fastdist-swap-")]


def open_swap_fds(directory):
    """This process's open descriptors of (unlinked) swap files under `directory`."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(os.path.join(str(directory), "fastdist-swap-")):
            found.append(target)
    return found


@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("depth", [0, 2])
def test_gradients_are_bitwise_equal_with_and_without_the_prefetcher(kind, depth, tmp_path):
    model, x = make(kind)
    reference = grads_of(model, x)
    prefetcher = SwapPrefetcher(min_bytes=4096, prefetch_depth=depth, store="file", path=str(tmp_path))
    for _ in range(2):  # the second step reuses the store's freed file extents
        swapped = grads_of(model, x, prefetcher)
        assert all(torch.equal(a, b) for a, b in zip(reference, swapped))
    prefetcher.synchronize()
    s = prefetcher.stats()
    assert s["tensors_swapped"] > 0 and s["bytes_swapped"] > 0
    assert s["bytes_read"] > 0 and s["resident_bytes"] == 0 and s["live_swapped_storages"] == 0
    prefetcher.close()


def test_a_swapped_activation_is_freed_once_its_copy_has_landed_and_comes_back_exact(tmp_path):
    x = torch.randn(512, 512, requires_grad=True)
    prefetcher = SwapPrefetcher(min_bytes=1 << 16, store="file", path=str(tmp_path))
    with prefetcher:
        hidden = x * 3.0
        out = hidden.sin()  # saves `hidden`
    expected = hidden.cos().detach()
    weak = StorageWeakRef(hidden.untyped_storage())
    del hidden
    prefetcher.synchronize()
    assert weak.expired(), "the prefetcher still holds the activation after its write landed"
    assert prefetcher.stats()["resident_bytes"] == 0
    out.backward(torch.ones_like(out))
    assert torch.equal(x.grad, 3.0 * expected)
    prefetcher.close()


def test_peak_resident_bytes_stay_below_the_swapped_total_on_a_deep_stack(tmp_path):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh()) for _ in range(12)])
    prefetcher = SwapPrefetcher(min_bytes=1 << 16, prefetch_depth=1, store="file", path=str(tmp_path))
    x = torch.randn(1024, 256)
    with prefetcher:
        loss = layers(x).sum()
    prefetcher.synchronize()
    assert prefetcher.stats()["resident_bytes"] == 0
    loss.backward()
    s = prefetcher.stats()
    assert s["bytes_swapped"] >= 12 * 1024 * 256 * 4
    assert s["peak_resident_bytes"] < s["bytes_swapped"]
    prefetcher.close()


def test_views_of_one_storage_are_swapped_once(tmp_path):
    a = torch.randn(256, 256, requires_grad=True)
    prefetcher = SwapPrefetcher(min_bytes=1 << 12, store="file", path=str(tmp_path))
    with prefetcher:
        y = a.sin()
        z = (y * y).sum() + (y.t() @ y[:, :3]).sum()  # y saved by mul twice, by mm as a transpose and a slice
    z.backward()
    ref = a.detach().clone().requires_grad_()
    yr = ref.sin()
    ((yr * yr).sum() + (yr.t() @ yr[:, :3]).sum()).backward()
    assert torch.equal(a.grad, ref.grad)
    s = prefetcher.stats()
    assert s["views_deduplicated"] >= 3
    # one copy of y (256 KiB) and of a.cos() inputs at most: y's storage is written exactly once
    assert s["bytes_swapped"] <= 2 * 256 * 256 * 4
    prefetcher.close()


def test_parameters_and_small_tensors_stay_resident(tmp_path):
    lin = torch.nn.Linear(512, 512)
    prefetcher = SwapPrefetcher(min_bytes=1 << 16, store="file", path=str(tmp_path))
    with prefetcher:
        small = torch.randn(4, 4, requires_grad=True).exp().sin()  # 64-byte activation: kept
        out = (lin(torch.randn(64, 512)).relu() * lin.weight[:64]).sum() + small.sum()
    out.backward()
    s = prefetcher.stats()
    assert s["bytes_kept"] >= lin.weight[:64].nbytes + small.nbytes  # the weight view and the small activation
    assert s["tensors_swapped"] == 2  # linear's input and relu's output, 128 KiB each; never the weight
    assert s["bytes_swapped"] == 2 * 64 * 512 * 4
    prefetcher.close()


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_backward_reads_in_reverse_pack_order_and_at_most_depth_storages_ahead(depth, tmp_path):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh()) for _ in range(6)])
    prefetcher = SwapPrefetcher(min_bytes=1 << 16, prefetch_depth=depth, store="file", path=str(tmp_path))
    with prefetcher:
        loss = layers(torch.randn(256, 128)).sum()
    prefetcher.synchronize()  # every write has landed, so every storage must be read back
    pack_order = [entry.slot[0] for entry in prefetcher._order]
    reads, consumed = [], []  # (storage, consumptions so far when its read was issued); storages consumed
    store_read, consume = prefetcher.store.read, prefetcher._consume

    def traced_read(slot):
        reads.append((slot[0], len(consumed)))
        return store_read(slot)

    def traced_consume(entry, handle_id):
        consumed.append(entry.slot[0])
        consume(entry, handle_id)

    prefetcher.store.read, prefetcher._consume = traced_read, traced_consume
    loss.backward()
    assert [offset for offset, _ in reads] == list(reversed(pack_order))
    first_use = {offset: consumed.index(offset) for offset in pack_order}
    ahead = [issued < first_use[offset] for offset, issued in reads]
    assert ahead[0] is False  # nothing tells the prefetcher what backward needs first
    assert all(ahead[1:]) if depth else not any(ahead)
    for offset, issued in reads:  # storages brought in but not used yet when this read was issued
        waiting = sum(1 for o, i in reads if i <= issued and first_use[o] >= issued)
        assert waiting <= depth + 1
    prefetcher.close()


def _random_step(gen, weights, x):
    """A random chain of saved-tensor-heavy ops over `weights` (views and in-graph reuse included)."""
    h = x
    for w in weights:
        h = torch.tanh(h @ w)
        if torch.rand((), generator=gen) < 0.5:
            h = h * h.sigmoid() + h[:, : h.shape[1]].exp().mul(0.01)
    return h.square().mean()


def _stress_step(prefetcher, weights, x, step):
    """One stress step's gradients; mode step % 4 picks how backward runs. prefetcher=None: the reference."""
    mode = step % 4
    ws = [w.detach().clone().requires_grad_() for w in weights]
    xi = x.detach().clone().requires_grad_()
    hooks = prefetcher if prefetcher is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                                              lambda t: t)
    with hooks:
        loss = _random_step(torch.Generator().manual_seed(step), ws, xi)
        other = _random_step(torch.Generator().manual_seed(step + 1000), ws, xi * 2) if mode == 3 else None
    if mode == 0:
        loss.backward()
    elif mode == 1:  # a retained graph is unpacked twice: the second pass reads the store again
        loss.backward(retain_graph=True)
        loss.backward()
    elif mode == 2:  # double backward: the first backward's saved tensors are swapped too
        with hooks:
            (gx,) = torch.autograd.grad(loss, xi, create_graph=True)
        gx.square().sum().backward()
    else:  # two live graphs, backward in the opposite order of forward
        other.backward()
        loss.backward()
    return [w.grad for w in ws] + [xi.grad]


def test_stress_many_steps_random_shapes_retained_graphs_and_double_backward_see_no_stale_data(tmp_path):
    gen = torch.Generator().manual_seed(0)
    prefetcher = SwapPrefetcher(min_bytes=1 << 10, prefetch_depth=2, store="file", path=str(tmp_path))
    for step in range(40):
        rows = int(torch.randint(8, 200, (), generator=gen))
        widths = [int(v) for v in torch.randint(8, 96, (4,), generator=gen)]
        weights = [(torch.randn(a, b, generator=gen) / a ** 0.5).requires_grad_()
                   for a, b in itertools.pairwise(widths)]
        x = torch.randn(rows, widths[0], generator=gen).requires_grad_()
        expected, got = _stress_step(None, weights, x, step), _stress_step(prefetcher, weights, x, step)
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), f"step {step} (mode {step % 4}) differs"
    prefetcher.synchronize()  # the last graph may have died before its writes landed
    s = prefetcher.stats()
    assert s["live_swapped_storages"] == 0 and s["resident_bytes"] == 0
    assert s["bytes_read"] > s["bytes_swapped"] * 0.5
    prefetcher.close()


def test_the_file_is_unlinked_at_once_and_its_descriptor_closed_on_close(tmp_path):
    prefetcher = SwapPrefetcher(min_bytes=0, store="file", path=str(tmp_path))
    a = torch.randn(1000, requires_grad=True)
    with prefetcher:
        loss = (a.exp() * 2).sin().sum()
        assert swap_files(tmp_path) == []  # nothing named on disk, even while in use
        assert len(open_swap_fds(tmp_path)) == 1
    loss.backward()
    prefetcher.close()
    assert swap_files(tmp_path) == [] and open_swap_fds(tmp_path) == []
    prefetcher.close()  # idempotent


def test_an_exception_in_forward_closes_the_store_and_the_prefetcher_opens_a_new_one_next_time(tmp_path):
    prefetcher = SwapPrefetcher(min_bytes=0, store="file", path=str(tmp_path))
    a = torch.randn(1000, requires_grad=True)
    with pytest.raises(ValueError, match="boom"), prefetcher:
        partial = a.exp().sin()
        raise ValueError("boom")
    assert open_swap_fds(tmp_path) == [] and swap_files(tmp_path) == []
    with pytest.raises(RuntimeError, match="closed"):
        partial.sum().backward()  # its saved tensors went with the closed store: a clear error, not garbage
    with prefetcher:
        loss = a.exp().sin().sum()
    loss.backward()
    assert torch.equal(a.grad, (a.exp().cos() * a.exp()).detach())
    prefetcher.close()
    assert open_swap_fds(tmp_path) == []


def test_an_exception_in_backward_leaves_nothing_behind_after_close(tmp_path):
    prefetcher = SwapPrefetcher(min_bytes=0, store="file", path=str(tmp_path))
    a = torch.randn(1000, requires_grad=True)
    with prefetcher:
        h = a.exp().sin()
    h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("hook failed")))
    with pytest.raises(RuntimeError, match="hook failed"):
        h.sum().backward()
    del h
    gc.collect()
    assert prefetcher.stats()["live_swapped_storages"] == 0  # the graph died: its file extents were freed
    prefetcher.close()
    assert open_swap_fds(tmp_path) == [] and swap_files(tmp_path) == []


def test_an_unreferenced_prefetcher_closes_its_file_when_collected(tmp_path):
    prefetcher = SwapPrefetcher(min_bytes=0, store="file", path=str(tmp_path))
    with prefetcher:
        (torch.randn(100, requires_grad=True) * 2).exp().sum().backward()
    assert len(open_swap_fds(tmp_path)) == 1
    del prefetcher
    gc.collect()
    assert open_swap_fds(tmp_path) == []


def test_bad_arguments_are_rejected_with_the_argument_named():
    with pytest.raises(ValueError, match="store"):
        SwapPrefetcher(store="disk")
    with pytest.raises(ValueError, match="prefetch_depth"):
        SwapPrefetcher(prefetch_depth=-1)
    with pytest.raises(ValueError, match="min_bytes"):
        SwapPrefetcher(min_bytes=-5)
    with pytest.raises(ValueError, match="io_threads"):
        SwapPrefetcher(io_threads=0)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            SwapPrefetcher(store="pinned")
    assert SwapPrefetcher().store_kind == ("pinned" if torch.cuda.is_available() else "file")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned store needs a CUDA device")
@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_pinned_store_gradients_are_bitwise_equal_on_cuda(kind):
    model, x = make(kind)
    model, x = model.cuda(), x.cuda()
    reference = grads_of(model, x)
    prefetcher = SwapPrefetcher(min_bytes=4096, prefetch_depth=2, store="pinned")
    for _ in range(3):
        swapped = grads_of(model, x, prefetcher)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(reference, swapped))
    prefetcher.synchronize()
    s = prefetcher.stats()
    assert s["tensors_swapped"] > 0 and s["copy_seconds"] > 0 and s["resident_bytes"] == 0
    prefetcher.close()


def test_a_gradient_hook_starts_the_first_reads_before_backward_reaches_the_swapped_tensors(tmp_path):
    torch.manual_seed(0)
    swapped_part = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128),
                                       torch.nn.Tanh())
    kept_part = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh())
    x = torch.randn(256, 128)
    kept_part(swapped_part(x)).sum().backward()
    expected = [p.grad.clone() for p in swapped_part.parameters()]
    for with_trigger in (False, True):
        swapped_part.zero_grad()
        prefetcher = SwapPrefetcher(min_bytes=1 << 16, prefetch_depth=2, store="file", path=str(tmp_path))
        with prefetcher:
            h = swapped_part(x)
        mark = prefetcher.mark()
        out = kept_part(h)  # not swapped: its backward is work the first reads can hide behind
        if with_trigger:
            prefetcher.prefetch_on_grad(out, upto=mark)
        prefetcher.synchronize()
        last_packed = prefetcher._order[-1].slot
        reads, unpacking = [], []
        store_read, prefetch_before = prefetcher.store.read, prefetcher._prefetch_before

        def traced_read(slot, reads=reads, unpacking=unpacking, store_read=store_read):
            reads.append((slot, bool(unpacking)))
            return store_read(slot)

        def traced_prefetch_before(entry, unpacking=unpacking, prefetch_before=prefetch_before):
            unpacking.append(entry)  # runs inside every swapped unpack
            prefetch_before(entry)

        prefetcher.store.read, prefetcher._prefetch_before = traced_read, traced_prefetch_before
        out.sum().backward()
        assert all(torch.equal(a, p.grad) for a, p in zip(expected, swapped_part.parameters()))
        before_any_unpack = [slot for slot, during in reads if not during]
        assert before_any_unpack[0] == last_packed  # the storage backward needs first
        # with the hook, `depth` reads start during kept_part's backward; without it, backward's first unpack
        # has to issue its own read and wait for it
        assert len(before_any_unpack) == (2 if with_trigger else 1)
        prefetcher.close()


def test_back_pressure_bounds_the_bytes_still_being_written_when_forward_returns(tmp_path):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh()) for _ in range(8)])
    x = torch.randn(512, 256)
    expected = torch.autograd.grad(layers(x).sum(), list(layers.parameters()))
    storage = 512 * 256 * 4
    for limit in (0, storage):
        prefetcher = SwapPrefetcher(min_bytes=1 << 16, store="file", path=str(tmp_path), max_inflight_bytes=limit)
        with prefetcher:
            loss = layers(x).sum()
            # every pack returned with at most `limit` bytes not yet written: that is all forward may hold
            assert prefetcher._writing_bytes <= limit
            assert prefetcher.stats()["resident_bytes"] <= limit
        got = torch.autograd.grad(loss, list(layers.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
        prefetcher.close()
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        SwapPrefetcher(max_inflight_bytes=-1)
