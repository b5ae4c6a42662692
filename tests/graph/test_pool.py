"""HAPPool: one coarsening level on dense padded graphs, and its sparse-batch wrapper."""
import io
import subprocess
import sys

import pytest
import torch

from fastdist.graph import HAPPool, PoolLosses, SparseHAPPool, densify


def random_batch(sizes, features=6, pad=None, seed=0, dtype=torch.float32):
    """Padded batch of random undirected graphs with the given node counts: (x, adj, mask)."""
    gen = torch.Generator().manual_seed(seed)
    pad = pad or max(sizes)
    x = torch.randn(len(sizes), pad, features, generator=gen, dtype=dtype)
    adj = torch.zeros(len(sizes), pad, pad, dtype=dtype)
    mask = torch.zeros(len(sizes), pad, dtype=torch.bool)
    for b, n in enumerate(sizes):
        upper = (torch.rand(n, n, generator=gen) < 0.3).triu(1).to(dtype)
        adj[b, :n, :n] = upper + upper.T
        mask[b, :n] = True
    return x, adj, mask


def make_pool(seed=0, **kw):
    torch.manual_seed(seed)
    return HAPPool(6, 3, **({"hops": 2, "heads": 2} | kw))


def test_padded_entries_never_influence_the_pooled_graph():
    pool = make_pool()
    x, adj, mask = random_batch([5, 8, 3], pad=10)
    want = pool(x, adj, mask, return_assignment=True)
    pad = ~mask
    x2, adj2 = x.clone(), adj.clone()
    x2[pad] = torch.nan  # anything, even NaN, in padding
    adj2[pad[:, :, None].expand_as(adj2)] = 7.0
    adj2[pad[:, None, :].expand_as(adj2)] = float("inf")
    got = pool(x2, adj2, mask, return_assignment=True)
    for g, w in zip(got[:2], want[:2]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(got[2]), torch.stack(want[2]), rtol=0, atol=0)
    assert (got[3][pad] == 0).all()
    # and padding a batch further (more padded nodes) changes nothing either
    x3, adj3, mask3 = random_batch([5, 8, 3], pad=13)
    x3[:, :10], adj3[:, :10, :10], mask3[:, :10] = x, adj, mask
    for g, w in zip(pool(x3, adj3, mask3)[:2], want[:2]):
        torch.testing.assert_close(g, w)


def test_the_pooled_graph_is_invariant_to_node_order_and_the_assignment_permutes_with_it():
    pool = make_pool()
    x, adj, mask = random_batch([9], dtype=torch.float64)
    pool = pool.double()
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(3))
    x_p, adj_p = x[:, perm], adj[:, perm][:, :, perm]
    x_out, adj_out, losses, s = pool(x, adj, mask, return_assignment=True)
    x_out_p, adj_out_p, losses_p, s_p = pool(x_p, adj_p, mask, return_assignment=True)
    torch.testing.assert_close(x_out_p, x_out)
    torch.testing.assert_close(adj_out_p, adj_out)
    torch.testing.assert_close(torch.stack(losses_p), torch.stack(losses))
    torch.testing.assert_close(s_p, s[:, perm])


def test_coarsened_adjacency_is_symmetric_when_the_input_is_and_shapes_follow_the_clusters():
    pool = HAPPool(6, 4, out_channels=8, heads=4)
    x, adj, mask = random_batch([7, 4], pad=7)
    x_out, adj_out, losses = pool(x, adj, mask)
    assert x_out.shape == (2, 4, 8) and adj_out.shape == (2, 4, 4)
    torch.testing.assert_close(adj_out, adj_out.transpose(1, 2))
    assert isinstance(losses, PoolLosses) and all(v.dim() == 0 and v >= 0 for v in losses)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_outputs_keep_the_input_dtype(dtype):
    pool = make_pool().to(dtype)
    x, adj, mask = random_batch([4, 6], dtype=dtype)
    x_out, adj_out, losses = pool(x, adj, mask)
    assert x_out.dtype == adj_out.dtype == losses.total().dtype == dtype


@pytest.mark.parametrize("kw", [{}, {"moa": False}, {"gcont": False}, {"hops": 0}, {"normalize": True},
                                {"content_scale": 0.1}])
def test_gradients_reach_every_parameter(kw):
    pool = make_pool(**kw)
    x, adj, mask = random_batch([5, 8, 3])
    x_out, adj_out, losses = pool(x, adj, mask)
    (x_out.square().mean() + adj_out.mean() + losses.total()).backward()
    missing = [n for n, p in pool.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_gradcheck_in_float64():
    pool = make_pool().double()
    x, adj, mask = random_batch([4, 3], dtype=torch.float64)
    x.requires_grad_()
    adj = (adj + 0.5).requires_grad_()  # weighted, so that gradcheck's perturbations stay non-negative

    def f(x, adj):
        x_out, adj_out, losses = pool(x, adj, mask)
        return x_out, adj_out, losses.total()

    assert torch.autograd.gradcheck(f, (x, adj), fast_mode=True)


def test_same_seed_same_pool_and_state_dict_round_trips():
    x, adj, mask = random_batch([5, 8])
    a, b = make_pool(seed=7), make_pool(seed=7)
    torch.testing.assert_close(a(x, adj, mask)[0], b(x, adj, mask)[0], rtol=0, atol=0)
    other = make_pool(seed=8)
    assert not torch.equal(other(x, adj, mask)[0], a(x, adj, mask)[0])
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    other.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    torch.testing.assert_close(other(x, adj, mask)[0], a(x, adj, mask)[0], rtol=0, atol=0)


def test_the_result_does_not_depend_on_the_thread_count():
    pool = make_pool().double()
    x, adj, mask = random_batch([30, 17], dtype=torch.float64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = pool(x, adj, mask)[:2]
        torch.set_num_threads(2)
        two = pool(x, adj, mask)[:2]
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mutate, error, match", [
    (lambda x, adj, mask: (x, adj, torch.zeros_like(mask)), ValueError, r"graph\(s\) \[0, 1\].*no nodes"),
    (lambda x, adj, mask: (x[:, :, :4], adj, mask), ValueError, "4 features per node.*in_channels=6"),
    (lambda x, adj, mask: (x, adj, mask[:, :5]), ValueError, "larger than the padding"),
    (lambda x, adj, mask: (x, adj[:, :5], mask), ValueError, "adj must be"),
    (lambda x, adj, mask: (x[0], adj, mask), ValueError, "expected x"),
    (lambda x, adj, mask: (x.index_put((torch.tensor([0]), torch.tensor([1])), torch.tensor(float("nan"))),
                           adj, mask), ValueError, "NaN"),
    (lambda x, adj, mask: (x, adj.index_put((torch.tensor([1]), torch.tensor([0]), torch.tensor([1])),
                                            torch.tensor(float("nan"))), mask), ValueError, "adj has NaN"),
    (lambda x, adj, mask: (x, -adj, mask), ValueError, "negative"),
    (lambda x, adj, mask: (x.double(), adj, mask), TypeError, "float64.*float32"),
    (lambda x, adj, mask: (x, adj, mask.float()), TypeError, "bool"),
    (lambda x, adj, mask: (x[:0], adj[:0], mask[:0]), ValueError, "batch is empty"),
])
def test_bad_inputs_raise_clear_errors(mutate, error, match):
    pool = make_pool()
    x, adj, mask = random_batch([6, 4])
    with pytest.raises(error, match=match):
        pool(*mutate(x, adj, mask))


@pytest.mark.parametrize("kw, match", [({"heads": 4, "out_channels": 6}, "divide"), ({"num_clusters": 0}, ">= 1"),
                                       ({"hops": -1}, "hops"), ({"dropout": 1.0}, "dropout"),
                                       ({"content_scale": 0.0}, "content_scale"),
                                       ({"content_scale": float("nan")}, "content_scale")])
def test_bad_hyper_parameters_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        HAPPool(**({"in_channels": 6, "num_clusters": 3, "heads": 2} | kw))


def test_content_scale_shrinks_the_shared_content_and_normalize_gives_the_pooled_part_unit_scale():
    x, adj, mask = random_batch([5, 8, 3])
    full, small = make_pool(seed=1), make_pool(seed=1, content_scale=0.1)
    torch.testing.assert_close(small.content, 0.1 * full.content)
    pool = make_pool(seed=1, normalize=True)
    x_out, _, _ = pool(x, adj, mask)
    part = x_out - pool.content  # what the graph contributes, before the shared content is added
    torch.testing.assert_close(part.mean(-1), torch.zeros(3, 3), atol=1e-5, rtol=0)
    torch.testing.assert_close(part.var(-1, unbiased=False), torch.ones(3, 3), atol=1e-3, rtol=0)


def _sparse(x, adj, mask):
    """The padded batch as PyG's sparse batch (x, edge_index, batch, edge_weight)."""
    b, i, j = adj.nonzero(as_tuple=True)
    offsets = torch.cumsum(mask.sum(1), 0) - mask.sum(1)
    batch = torch.arange(len(mask)).repeat_interleave(mask.sum(1))
    edge_index = torch.stack([i + offsets[b], j + offsets[b]])
    return x[mask], edge_index, batch, adj[b, i, j]


def test_the_pool_compiles_as_one_graph_without_input_checks_and_matches_eager():
    pool = make_pool(check_inputs=False)
    x, adj, mask = random_batch([5, 8, 3], pad=10)
    x.requires_grad_(True)

    def pooled_and_input_grad(forward):
        pooled, pooled_adj, losses = forward(x, adj, mask)
        (pooled.sum() + pooled_adj.sum() + sum(losses)).backward()
        grad, x.grad = x.grad.clone(), None
        return pooled.detach(), pooled_adj.detach(), grad

    eager = pooled_and_input_grad(pool)
    compiled = pooled_and_input_grad(torch.compile(pool, fullgraph=True))
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_the_sparse_wrapper_equals_the_dense_call():
    pool = make_pool()
    x, adj, mask = random_batch([5, 8, 3], pad=8)
    adj = adj * torch.rand(adj.shape, generator=torch.Generator().manual_seed(1)).add(0.5)
    adj = (adj + adj.transpose(1, 2)) / 2
    xs, edge_index, batch, weight = _sparse(x, adj, mask)
    want = pool(x, adj, mask, return_assignment=True)
    got = SparseHAPPool(pool)(xs, edge_index, batch, weight, return_assignment=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g if isinstance(g, torch.Tensor) else torch.stack(g),
                                   w if isinstance(w, torch.Tensor) else torch.stack(w))


def test_densify_refuses_a_graph_larger_than_the_padding_and_an_unsorted_batch():
    x, adj, mask = random_batch([5, 8])
    xs, edge_index, batch, _ = _sparse(x, adj, mask)
    with pytest.raises(ValueError, match=r"graph\(s\) \[1\] have 8 nodes.*max_num_nodes=6"):
        densify(xs, edge_index, batch, max_num_nodes=6)
    with pytest.raises(ValueError, match="sorted"):
        densify(xs, edge_index, batch.flip(0))
    xd, _, md = densify(xs, edge_index, batch, max_num_nodes=10)
    assert xd.shape == (2, 10, 6) and md.sum().item() == 13


def test_the_sparse_wrapper_refuses_graphs_larger_than_its_padding_empty_graphs_and_other_feature_sizes():
    x, adj, mask = random_batch([5, 8])
    xs, edge_index, batch, weight = _sparse(x, adj, mask)
    with pytest.raises(ValueError, match=r"graph\(s\) \[1\] have 8 nodes.*max_num_nodes=6"):
        SparseHAPPool(make_pool(), max_num_nodes=6)(xs, edge_index, batch, weight)
    with pytest.raises(ValueError, match="4 features per node.*in_channels=6"):
        SparseHAPPool(make_pool())(xs[:, :4], edge_index, batch, weight)
    with pytest.raises(ValueError, match=r"graph\(s\) \[1\].*no nodes"):  # graph 1 of three has no nodes
        SparseHAPPool(make_pool())(xs, edge_index, batch * 2, weight)


def test_the_dense_pool_imports_without_torch_geometric_and_the_sparse_path_names_the_extra():
    code = ("import sys; sys.modules['torch_geometric'] = None\n"
            "import torch, fastdist, fastdist.graph as g\n"
            "p = g.HAPPool(3, 2, heads=1)\n"
            "print(tuple(p(torch.randn(1, 4, 3), torch.ones(1, 4, 4))[0].shape))\n"
            "try:\n"
            "    g.densify(torch.randn(4, 3), torch.zeros(2, 0, dtype=torch.long))\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    shape, message = proc.stdout.splitlines()[:2]
    assert shape == "(1, 2, 3)"
    assert "pip install torch-geometric" in message and "'graph' extra" in message
